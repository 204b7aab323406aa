"""The machine record that CI logs and benchmark JSON carry."""

from vllm_dflash import machine


def test_machine_info_reads_this_cpu():
    info = machine.machine_info()
    assert info["cpu_model"]
    assert info["cores"] >= 1
    assert set(info["isa"]) == set(machine.ISA_FLAGS.values())
    assert info["torch"] and info["vllm"].startswith("0.32.0")  # "0.32.0+cpu": the CPU build's alias record
    flags = set(open("/proc/cpuinfo").read().split())
    assert info["isa"]["AVX2"] == ("avx2" in flags)
    assert info["isa"]["AMX"] == ("amx_tile" in flags)
    # the generation, which the model name alone may not tell ("AMD EPYC" covered two here)
    fields = dict(line.split(":", 1) for line in open("/proc/cpuinfo").read().split("\n\n")[0].splitlines()
                  if ":" in line)
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    assert (info["cpu_family"], info["cpu_model_number"], info["cpu_stepping"]) == (
        fields.get("cpu family"), fields.get("model"), fields.get("stepping"))
    assert info["cpu_family"] is None or f"family {info['cpu_family']} model " in machine.describe(info)


def test_describe_names_model_isa_and_versions():
    info = {"cpu_model": "Test CPU", "arch": "x86_64", "cores": 2, "torch": "2.13.0+cpu", "vllm": "0.32.0",
            "isa": {name: name == "AVX2" for name in machine.ISA_FLAGS.values()}, "gpu": None}
    assert machine.describe(info) == "Test CPU (x86_64, 2 cores; ISA: AVX2); torch 2.13.0+cpu, vLLM 0.32.0"
    info["isa"] = {name: False for name in machine.ISA_FLAGS.values()}
    assert "ISA: none of AVX2/AVX-512/AVX512_BF16/AMX/AMX_BF16" in machine.describe(info)
    info.update(cpu_family="25", cpu_model_number="17", cpu_stepping="1")
    assert machine.describe(info).startswith("Test CPU (family 25 model 17 stepping 1, x86_64, 2 cores; ")
