"""``scripts/check_served_sizes.py`` on the CPU: a table's winners run as serving runs them at every
size an engine calls with, and a winner wrong at a size between the table's buckets is named."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import check_served_sizes as check  # noqa: E402

from moetune.runtime.registry import default_registry  # noqa: E402
from moetune.tuner.presets import preset  # noqa: E402
from tests.vllm_tables import write_winners  # noqa: E402

SHAPE = preset("tiny").shape


def test_sizes_spell_ranges_and_steps():
    assert check.sizes("1,2,8-32:8,100") == [1, 2, 8, 16, 24, 32, 100]


def test_every_size_between_and_beyond_the_buckets_is_run_and_checked(tmp_path, capsys):
    table = write_winners(tmp_path / "t.db", SHAPE, [1, 16, 64], "torch_grouped")
    assert check.main(["--preset", "tiny", "--table", str(table), "--device", "cpu",
                       "--sizes", "1-5,16,40,300"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]  # after the plan's summary
    assert [line.split(":")[0] for line in lines] == [
        f"M={m}" for m in (1, 2, 3, 4, 5, 16, 40, 300)]
    assert all("torch_grouped" in line and "error" in line for line in lines)


def test_a_winner_wrong_at_one_size_is_named(tmp_path, capsys, monkeypatch):
    """A kernel right at the bucket points and wrong at 7 tokens (a size no bucket is): the
    check stops there, naming the kernel and where it was prepared."""
    table = write_winners(tmp_path / "t.db", SHAPE, [1, 16], "torch_grouped")
    kernel = default_registry.get("torch_grouped")
    prepare = kernel.prepare

    def broken(problem, params, weights):
        fn = prepare(problem, params, weights)

        def run(x, topk_weights, topk_ids, out=None):
            result = fn(x, topk_weights, topk_ids, out=out)
            return result.mul_(2) if x.shape[0] == 7 else result

        return run

    monkeypatch.setattr(kernel, "prepare", broken)
    assert check.main(["--preset", "tiny", "--table", str(table), "--device", "cpu",
                       "--sizes", "1,6,7,8"]) == 1
    out = capsys.readouterr().out
    assert "M=6: torch_grouped" in out and "WRONG" in out
    assert out.splitlines()[-2].startswith("M=7: torch_grouped {} (prepared at M=1)")
