"""`unisched run` for long runs: logs, checkpoints, an exact resume (with
bf16, clipping and a cosine schedule with warm-up), and your own strategy
named MODULE:FUNCTION.  Each run takes the example's
arguments exactly as `unisched run --dry-run` prints them for torchrun and
runs that program on 2 gloo ranks."""

from __future__ import annotations

import contextlib
import io
import json
import shlex
import textwrap

import pytest
import torch

from unisched.cli import main
from unisched.execute import command
from unisched.execute.checkpoint import read_checkpoint, step_checkpoint
from unisched.execute.launch import run_local


def example_argv(capsys, *options: str) -> list[str]:
    """The arguments `unisched run -W 2 ...` gives each rank's program."""
    assert main(["run", "-W", "2", *options, "--dry-run"]) == 0
    printed = shlex.split(capsys.readouterr().out)
    return printed[printed.index("unisched.execute.example") + 1:]


def _example(rank: int, world: int, argv: list[str]):
    """(exit status, what the rank printed, what it wrote to stderr)."""
    from unisched.execute.example import main as example_main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = example_main(argv)
    return code, out.getvalue(), err.getvalue()


def run_example(argv: list[str]) -> str:
    """Rank 0's output of the example on 2 ranks (every rank must exit 0)."""
    results = run_local(_example, 2, argv, timeout=120)
    for r in results:
        assert r.error is None, f"rank {r.rank}: {r.error}"
        assert r.value[0] == 0, f"rank {r.rank} exited {r.value[0]}: {r.value[2]}"
    assert results[1].value[1] == "", "only rank 0 prints"
    assert "calibrate_costs" not in results[0].value[2], "predicting the schedule measured warns of nothing"
    return results[0].value[1]


def test_a_resumed_run_continues_exactly(capsys, tmp_path):
    first, again = tmp_path / "first", tmp_path / "again"
    common = ["--strategy", "gpipe", "--optimizer", "adam", "--check", "--precision", "bf16", "--clip-grad-norm", "0.5",
              "--lr-schedule", "cosine", "--warmup-steps", "2"]
    argv = example_argv(capsys, *common, "--steps", "4", "--log-every", "2", "--checkpoint", str(first),
                        "--checkpoint-every", "2", "--json")
    for flag in ("--checkpoint-every", "--log-every", "--optimizer", "--precision", "--clip-grad-norm", "--lr-schedule",
                 "--warmup-steps"):
        assert flag in argv
    straight = json.loads(run_example(argv))
    assert straight["checkpoints"] == [str(step_checkpoint(first, 2)), str(step_checkpoint(first, 4))]
    assert [entry["step"] for entry in straight["log"]] == [2, 4]
    assert straight["log"][1]["loss"] == pytest.approx(sum(straight["losses"][2:]) / 2)
    assert all(entry["samples_per_s"] > 0 and entry["step_ms"] > 0 for entry in straight["log"])
    assert straight["check"]["passed"]

    argv = example_argv(capsys, *common, "--steps", "2", "--log-every", "1", "--resume",
                        str(step_checkpoint(first, 2)), "--checkpoint", str(again))
    printed = run_example(argv).splitlines()
    lines = [line for line in printed if line.startswith("step ") and "/4" in line]
    assert [line.split()[1] for line in lines] == ["3/4", "4/4"]
    for line, expected in zip(lines, straight["losses"][2:]):
        assert float(line.split()[3]) == pytest.approx(expected, abs=1e-4) and "samples/s" in line
    assert any(line.startswith("steps 4 (resumed after step 2)") for line in printed)
    assert any(line.startswith("check passed") for line in printed), "against one process trained 4 steps"

    unbroken, resumed = read_checkpoint(step_checkpoint(first, 4)), read_checkpoint(step_checkpoint(again, 4))
    assert any(key.endswith(".exp_avg") for key in unbroken), "Adam's state is kept"
    assert unbroken["trainer.scheduler"]["last_epoch"] == resumed["trainer.scheduler"]["last_epoch"] == 4
    assert unbroken["trainer.training_state"]["step"] == resumed["trainer.training_state"]["step"] == 4
    assert resumed["trainer.param_groups"] == unbroken["trainer.param_groups"], "the scheduled learning rate"
    for key, value in unbroken.items():
        if torch.is_tensor(value) and not key.startswith("trainer."):
            assert (resumed[key] - value).abs().max() < 1e-6, key

    # --check replays the steps before the checkpoint on this run's batches: other batches are refused
    argv = example_argv(capsys, *common, "-B", "2", "--steps", "1", "--resume", str(step_checkpoint(first, 2)))
    for rank in run_local(_example, 2, argv, timeout=120):
        assert rank.error is None and rank.value[0] == 2, rank
        assert "--check replays the steps before checkpoint" in rank.value[2] and "but they trained on" in rank.value[2]


def test_a_resumed_run_trains_at_its_own_learning_rate(capsys, tmp_path):
    """The checkpoint restores the optimizer's hyper-parameters, but the resumed run's learning
    rate follows its flags: after a cosine schedule ended (rate 0) a constant run trains, and
    each --lr gives its own losses, as one process would; --check refuses a checkpoint whose
    steps took another rate (its replay would fail however right the run)."""
    ended = tmp_path / "ended"
    run_example(example_argv(capsys, "--steps", "2", "--lr-schedule", "cosine", "--checkpoint", str(ended)))
    resumed = {}
    for lr in ("0.05", "0.2"):
        argv = example_argv(capsys, "--steps", "2", "--lr", lr, "--resume", str(ended), "--json")
        resumed[lr] = json.loads(run_example(argv))["losses"]
    assert resumed["0.05"][0] == resumed["0.2"][0], "the first resumed step starts from the same weights"
    # at the checkpoint's rate (0, where the cosine ended) both would train alike: not at all
    assert resumed["0.05"][1] != pytest.approx(resumed["0.2"][1], abs=1e-4), "--lr is followed"

    argv = example_argv(capsys, "--steps", "1", "--lr", "0.05", "--check", "--lr-schedule", "cosine",
                        "--resume", str(ended))
    argv_constant = example_argv(capsys, "--steps", "1", "--check", "--resume", str(ended))
    for argv, said in ((argv, "otherwise (ends_at 2 there, 3 here; lr default there, 0.05 here)"),
                       (argv_constant, "otherwise (ends_at 2 there, none here; schedule cosine there, constant here)")):
        for rank in run_local(_example, 2, argv, timeout=120):
            assert rank.error is None and rank.value[0] == 2, rank
            assert said in rank.value[2], rank.value[2]


def test_a_resumed_schedule_continues_at_the_step_reached_and_check_refuses_alike_on_every_rank(capsys, tmp_path):
    """A schedule resumed from a checkpoint without one starts at the checkpoint's step (it
    restarted at 0: step 3 trained at the warm-up's first rate); --check against a checkpoint
    trained at another rate is refused by every rank, also by one that holds no weights
    (overflow's rank 1), since each reads the checkpoint's own record of its rate."""
    constant, again = tmp_path / "constant", tmp_path / "again"
    run_example(example_argv(capsys, "--strategy", "overflow", "--steps", "2", "--checkpoint", str(constant)))
    run_example(example_argv(capsys, "--strategy", "overflow", "--steps", "1", "--warmup-steps", "4", "--resume",
                             str(constant), "--checkpoint", str(again)))
    assert read_checkpoint(step_checkpoint(again, 3))["trainer.scheduler"]["last_epoch"] == 3

    argv = example_argv(capsys, "--strategy", "overflow", "--steps", "1", "--lr", "0.05", "--lr-schedule", "cosine",
                        "--check", "--resume", str(constant))
    for rank in run_local(_example, 2, argv, timeout=120):
        assert rank.error is None and rank.value[0] == 2, rank
        assert ("otherwise (ends_at none there, 3 here; lr default there, 0.05 here; schedule constant there, "
                "cosine here)") in rank.value[2], rank.value[2]

    # a checkpoint of another optimizer or stage count is refused in the command's own flags, on every rank
    for more, said in ((["--optimizer", "adam"], "was trained with SGD, this run with --optimizer adam: resume with "
                                                  "--optimizer sgd"),
                       (["--strategy", "looped", "-S", "4"], "holds 1 stage but this run has 4: resume with -S 1")):
        argv = example_argv(capsys, "--strategy", "overflow", "--steps", "1", *more, "--resume", str(constant))
        for rank in run_local(_example, 2, argv, timeout=120):
            assert rank.error is None and rank.value[0] == 2, rank
            assert said in rank.value[2], rank.value[2]

    # a run resumed in another precision or with clipping trains otherwise than the replay of the steps before
    argv = example_argv(capsys, "--strategy", "overflow", "--steps", "1", "--precision", "bf16", "--clip-grad-norm",
                        "1", "--check", "--resume", str(constant))
    for rank in run_local(_example, 2, argv, timeout=120):
        assert rank.error is None and rank.value[0] == 2, rank
        assert "otherwise (clip_grad_norm default there, 1.0 here; precision fp32 there, bf16 here)" in rank.value[2]


STRATEGY = """
from unisched import ComputeAndWeightWorkers, Direction

def backwards_elsewhere(num_workers, num_stages, num_batches):
    def mapping(work):
        worker = work.stage % num_workers
        if work.direction != Direction.FORWARD:
            worker = num_workers - 1 - worker
        return ComputeAndWeightWorkers(worker, work.stage % num_workers)
    return mapping
"""


def test_your_own_strategy_runs_by_module_and_function(capsys, tmp_path):
    path = tmp_path / "mine.py"
    path.write_text(textwrap.dedent(STRATEGY))
    target = f"{path}:backwards_elsewhere"
    assert main(["run", "-W", "2", "--strategy", target, "--program", "--json"]) == 0
    programs = json.loads(capsys.readouterr().out)
    assert programs["stages"] == 2 and programs["batches"] == 4
    assert any(text.startswith("0B") for text in programs["ranks"][1]), "stage 0's backward runs on rank 1"
    argv = example_argv(capsys, "--strategy", target, "--steps", "2", "--check", "--json")
    report = json.loads(run_example(argv))
    assert report["strategy"] == target and report["check"]["passed"]


@pytest.mark.parametrize("argv,expected", [
    (["--strategy", "no_such_module_here:f"], "no_such_module_here"),
    (["--strategy", "unisched.work:no_such_function"], "unisched.work has no 'no_such_function'"),
    (["--strategy", "missing/file.py:f"], "no file missing/file.py"),
    (["--checkpoint-every", "2"], "--checkpoint-every needs --checkpoint DIR"),
    (["--resume", "no/such/dir"], "no checkpoint in no/such/dir: it does not exist"),
    (["--precision", "fp8"], "--precision fp8: choose one of fp32, bf16, fp16"),
])
def test_unisched_run_refuses_before_launching(capsys, monkeypatch, argv, expected):
    monkeypatch.setattr(command, "_launch", lambda argv: pytest.fail("launched"))
    assert main(["run", "-W", "2", *argv]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and expected in error[0] and "Traceback" not in error[0]


def test_a_fresh_run_refuses_a_checkpoint_directory_another_run_filled(capsys, monkeypatch, tmp_path):
    """Without --resume, a --checkpoint directory holding finished checkpoints would have them
    replaced one by one, and a later --resume pick up either run's: refused, naming the way on."""
    launched = []
    monkeypatch.setattr(command, "_launch", lambda argv: launched.append(argv) or 0)
    earlier = step_checkpoint(tmp_path, 4)
    earlier.mkdir()
    (tmp_path / "step-00000006.partial").mkdir()  # unfinished: not a checkpoint
    assert main(["run", "-W", "2", "--checkpoint", str(tmp_path)]) == 0, "only unfinished ones: saved over"
    (earlier / ".metadata").touch()
    assert main(["run", "-W", "2", "--checkpoint", str(tmp_path)]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == (f"unisched: error: --checkpoint {tmp_path} already holds another run's checkpoints (the latest "
                     f"step-00000004); continue that run with --resume {tmp_path}, or save this one in another "
                     "directory")
    assert main(["run", "-W", "2", "--checkpoint", str(tmp_path), "--resume", str(tmp_path), "--dry-run"]) == 0
    assert len(launched) == 1
    elsewhere = step_checkpoint(tmp_path / "other", 2)  # resuming another run into this directory mixes them too
    elsewhere.mkdir(parents=True)
    (elsewhere / ".metadata").touch()
    assert main(["run", "-W", "2", "--checkpoint", str(tmp_path), "--resume", str(elsewhere)]) == 2
    assert "already holds another run's checkpoints" in capsys.readouterr().err
    assert main(["run", "-W", "2", "--checkpoint", str(tmp_path / "other"), "--resume", str(elsewhere)]) == 0
    assert len(launched) == 2


def test_a_run_resumed_from_an_earlier_checkpoint_refuses_to_save_among_the_later_ones(capsys, monkeypatch, tmp_path):
    """Rolling back to step 2 of a run saved up to step 4 in the same directory left steps 3 and 4
    of the old branch there, and the next --resume of the directory took the old step 4."""
    monkeypatch.setattr(command, "_launch", lambda argv: pytest.fail("launched"))
    for step in (2, 3, 4):
        step_checkpoint(tmp_path, step).mkdir()
        (step_checkpoint(tmp_path, step) / ".metadata").touch()
    assert main(["run", "-W", "2", "--checkpoint", str(tmp_path), "--resume", str(step_checkpoint(tmp_path, 2))]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert ("holds checkpoints after the resumed step-00000002 (step-00000003, step-00000004): this run would save "
            "among them") in error


def test_places_nothing_can_be_written_are_refused_before_launching(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(command, "_launch", lambda argv: pytest.fail("launched"))
    (tmp_path / "afile").touch()
    for flag, path, said in (("--checkpoint", tmp_path / "afile" / "sub", "cannot write there"),
                             ("--timeline", tmp_path / "no" / "x.html", "there is no folder")):
        assert main(["run", "-W", "2", flag, str(path)]) == 2
        error = capsys.readouterr().err.strip().splitlines()
        assert len(error) == 1 and f"{flag} {path}: {said}" in error[0]
