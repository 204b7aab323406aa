"""Engines taking turns (vllm_dflash.bench.turns, `vllm-dflash bench --interleave`):
strictly one at a time, in index order, and a missing engine is an error, not a hang."""

from __future__ import annotations

import threading
import time

import pytest

from vllm_dflash.bench import turns


def test_engines_alternate_one_at_a_time(tmp_path):
    folder = str(tmp_path / "turns")
    turns.start(folder)
    log, running = [], []
    count, cells = 3, 4

    def engine(index: int) -> None:
        t = turns.Turns(folder, index, count, timeout_s=30)
        t.ready()
        for cell in range(cells):
            with t.turn():
                running.append(index)
                assert len(running) == 1, running  # nobody else inside
                log.append((cell, index))
                time.sleep(0.003)
                running.remove(index)

    threads = [threading.Thread(target=engine, args=(i,)) for i in reversed(range(count))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert log == [(cell, i) for cell in range(cells) for i in range(count)]


def test_a_missing_engine_times_out_with_a_clear_error(tmp_path):
    folder = str(tmp_path / "turns")
    turns.start(folder)
    t = turns.Turns(folder, 1, 2, timeout_s=0.05)
    with pytest.raises(TimeoutError, match="engine 1 waited 0.05s for every engine to be built"):
        t.ready()
    with pytest.raises(TimeoutError, match="for its turn"):
        with t.turn():
            pass


def test_start_clears_an_old_folder_and_index_is_checked(tmp_path):
    folder = str(tmp_path / "turns")
    turns.start(folder)
    open(f"{folder}/ready-0", "w").close()
    turns.start(folder)
    assert sorted(p.name for p in (tmp_path / "turns").iterdir()) == ["turn"]
    with pytest.raises(ValueError, match="turn index 2 outside 0..1"):
        turns.Turns(folder, 2, 2, timeout_s=1)
