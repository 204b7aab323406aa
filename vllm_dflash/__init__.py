"""vllm-dflash: DFlash block-diffusion speculative decoding for vLLM.

`register()` is the `vllm.general_plugins` entry point. vLLM calls it in the
engine process and in every worker before the model runner is built, so it is
where the plugin's draft model, proposer and verifier replace vLLM's.
It must stay cheap and import nothing heavy at module load (numba/llvmlite
imported at plugin load crash vLLM's CPU workers).
"""

import logging
import os

__version__ = "0.1.0"

logger = logging.getLogger("vllm_dflash")

_REGISTERED_PID: int | None = None


def register() -> None:
    """Install the plugin into the current vLLM process (idempotent)."""
    global _REGISTERED_PID
    if _REGISTERED_PID == os.getpid():
        return
    from vllm_dflash import patches

    patches.apply_all()
    _REGISTERED_PID = os.getpid()
    marker = os.environ.get("VLLM_DFLASH_REGISTER_MARKER_DIR")
    if marker:
        # Lets tests prove register() ran inside engine and worker processes.
        with open(os.path.join(marker, f"registered.{os.getpid()}"), "w") as f:
            f.write(__version__)
    logging.getLogger("vllm.vllm_dflash").info(
        "vllm-dflash %s registered (pid %d)", __version__, os.getpid()
    )
