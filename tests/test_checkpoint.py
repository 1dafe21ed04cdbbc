"""Checkpoints: bitwise round trips, resharding across world sizes, atomic saves, corruption
fallback, pruning, mismatch refusal, async saves and safe metadata reading."""

import hashlib
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from srtrain.checkpoint import (
    CHECKPOINTS_DIR,
    MARKER,
    CheckpointError,
    CheckpointManager,
    CheckpointMismatchError,
    CorruptCheckpointError,
    checkpoint_step,
    latest,
    load,
    load_latest_valid,
    read_full_model,
    resolve_resume,
)
from srtrain.models import build_model, init_weights
from srtrain.optim import SRAdamW
from srtrain.parallel import apply_fsdp, device_mesh

from distributed import free_port, join_gloo, leave_worker
from forged import forge, metadata_pointing_at

PRESET = "llama-tiny"
VOCAB = 257  # rows split unevenly over 2 and 3 ranks
SEQ = 16
BATCH = 6
SEED = 11
FORMATS = {"m_format": "fp8", "v_format": "fp4_e2m2"}
EXTRA = {
    "tokens": 4096,
    "lr": 1e-3,
    "loader": {"split": "train", "position": 12},
    "resets": {"age_m": 2, "age_v": 2},
}


# ------------------------------------------------------------------ helpers


def _optimizer(model, **formats) -> SRAdamW:
    return SRAdamW(model.parameters(), lr=1e-2, backend="torch", **{**FORMATS, **formats})


def _plain(seed: int = SEED, preset: str = PRESET, vocab: int = VOCAB, **formats):
    """An unsharded model and its SRAdamW, in this process (no process group)."""
    model = build_model(preset, vocab, SEQ, device="cpu")
    init_weights(model, seed)
    return model, _optimizer(model, **formats)


def _sharded(mesh, seed: int = SEED):
    model = build_model(PRESET, VOCAB, SEQ)
    apply_fsdp(model, mesh, param_dtype=torch.float32)
    model.to_empty(device="cpu")
    init_weights(model, seed)
    return model, _optimizer(model)


def _train(
    model, optimizer, steps: int, first_step: int = 1, rank: int = 0, world: int = 1
) -> None:
    """Steps on fixed global batches (each rank takes its rows)."""
    for step in range(first_step, first_step + steps):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
        rows = ids.chunk(world)[rank]
        model(input_ids=rows, labels=rows).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _full(model, optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer state tensor as a full (unsharded) tensor, by name."""

    def full(t):
        return t.full_tensor().clone() if isinstance(t, DTensor) else t.detach().clone()

    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"param/{n}": full(p) for n, p in model.named_parameters()}
    for p, state in optimizer.state.items():
        for key, value in state.items():
            out[f"state/{names[id(p)]}/{key}"] = full(value)
    return out


def _assert_bitwise(got: dict, want: dict, with_state: bool = True) -> None:
    assert got.keys() == want.keys()
    if with_state:
        assert any("m_codes" in k for k in want) and any("v_scales" in k for k in want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert torch.equal(got[name], want[name]), name


# ------------------------------------------------------------------ multi-process


def _train_world(tmp: Path, rank: int, world: int, mesh) -> dict:
    """World 2: save, bitwise round trip, exact continuation, async save, load from world 1."""
    out = {}
    model, opt = _sharded(mesh)
    _train(model, opt, 2, 1, rank, world)
    manager = CheckpointManager(tmp / "run2", keep=2)
    try:
        manager.save(2, model, opt, {"rank": rank})
    except ValueError as e:
        out["differing_extra"] = str(e)
    torch.manual_seed(100 + rank)
    manager.save(2, model, opt, EXTRA)
    manager.close()
    rng_after_save = torch.rand(4)
    out["saved"] = _full(model, opt)

    fresh, fresh_opt = _sharded(mesh, seed=SEED + 1)
    out["extra"] = load(latest(tmp / "run2"), fresh, fresh_opt)
    rng = torch.stack([rng_after_save, torch.rand(4)])
    gathered = [torch.zeros_like(rng) for _ in range(world)]
    dist.all_gather(gathered, rng)
    out["rng"] = torch.stack(gathered)
    out["loaded"] = _full(fresh, fresh_opt)

    _train(model, opt, 1, 3, rank, world)
    _train(fresh, fresh_opt, 1, 3, rank, world)
    out["continued"], out["continued_loaded"] = _full(model, opt), _full(fresh, fresh_opt)

    with CheckpointManager(tmp / "async", keep=1, async_save=True) as async_manager:
        async_manager.save(3, model, opt, EXTRA)
        _train(model, opt, 1, 4, rank, world)  # changes the state while the save runs
    async_fresh, async_opt = _sharded(mesh, seed=SEED + 2)
    load(latest(tmp / "async"), async_fresh, async_opt)
    out["async_loaded"] = _full(async_fresh, async_opt)

    from_one, from_one_opt = _sharded(mesh, seed=SEED + 3)
    load(latest(tmp / "run1"), from_one, from_one_opt)
    out["from_world1"] = _full(from_one, from_one_opt)
    return out


def _worker(rank: int, world: int, port: int, tmp: str, task: str) -> None:
    info = join_gloo(rank, world, port)
    mesh = device_mesh(info)
    tmp = Path(tmp)
    if task == "train":
        out = _train_world(tmp, rank, world, mesh)
    else:
        out = {}
        for source in ("run2", "run1"):
            model, opt = _sharded(mesh, seed=SEED + 4)
            load(latest(tmp / source), model, opt)
            out[source] = _full(model, opt)
    if rank == 0:
        torch.save(out, tmp / f"{task}-{world}.pt")
    dist.barrier()
    dist.destroy_process_group()
    leave_worker()


def _spawn(tmp: Path, world: int, task: str) -> dict:
    mp.spawn(_worker, args=(world, free_port(), str(tmp), task), nprocs=world)
    return torch.load(tmp / f"{task}-{world}.pt", weights_only=True)


@pytest.fixture(scope="module")
def worlds(tmp_path_factory) -> dict:
    """A world-1 checkpoint made here, a world-2 run, a world-3 load, a world-1 load."""
    tmp = tmp_path_factory.mktemp("worlds")
    model, opt = _plain()
    _train(model, opt, 2)
    with CheckpointManager(tmp / "run1", keep=1) as manager:
        manager.save(2, model, opt, EXTRA)
    results = {"world1_saved": _full(model, opt)}
    results["world2"] = _spawn(tmp, 2, "train")
    results["world3"] = _spawn(tmp, 3, "load")
    model, opt = _plain(seed=SEED + 5)
    load(latest(tmp / "run2"), model, opt)
    results["world2_into_1"] = _full(model, opt)
    results["tmp"] = tmp
    return results


@pytest.mark.slow
def test_round_trip_at_world_two_is_bitwise(worlds):
    two = worlds["world2"]
    _assert_bitwise(two["loaded"], two["saved"])
    assert two["extra"] == EXTRA
    assert sorted(p.name for p in (worlds["tmp"] / "run2" / CHECKPOINTS_DIR).iterdir()) == [
        "step-2"
    ]
    assert two["saved"]["state/model.embed_tokens.weight/m_codes"].dtype == torch.uint8
    assert int(two["saved"]["state/model.norm.weight/step"]) == 2


@pytest.mark.slow
def test_each_rank_restores_its_generator(worlds):
    rng = worlds["world2"]["rng"]  # [rank, (after save, after load), 4]
    assert torch.equal(rng[:, 0], rng[:, 1])
    assert not torch.equal(rng[0, 0], rng[1, 0])


@pytest.mark.slow
def test_resumed_run_continues_bitwise(worlds):
    two = worlds["world2"]
    _assert_bitwise(two["continued_loaded"], two["continued"])
    assert not torch.equal(
        two["continued"]["param/lm_head.weight"], two["saved"]["param/lm_head.weight"]
    )


@pytest.mark.slow
def test_extra_must_be_the_same_on_every_rank(worlds):
    assert worlds["world2"]["differing_extra"] == (
        "extra differs between ranks at ['rank']; it must hold the same global state on every rank"
    )


@pytest.mark.slow
def test_async_save_holds_the_state_at_save_time(worlds):
    two = worlds["world2"]
    _assert_bitwise(two["async_loaded"], two["continued"])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("source", "target"),
    [
        ("world2/saved", "world3/run2"),  # 2 → 3, 257 and 128 rows split 86/86/85 and 43/43/42
        ("world2/saved", "world2_into_1"),  # 2 → 1 (unsharded)
        ("world1_saved", "world2/from_world1"),  # 1 → 2
        ("world1_saved", "world3/run1"),  # 1 → 3
    ],
)
def test_resharded_load_gives_the_same_full_tensors(worlds, source, target):
    def pick(path):
        value = worlds
        for part in path.split("/"):
            value = value[part]
        return value

    _assert_bitwise(pick(target), pick(source))


# ------------------------------------------------------------------ single process


def _saved_run(tmp_path: Path, steps=(1, 2), keep: int = 5, **formats) -> dict[int, dict]:
    """Checkpoints of one unsharded run at ``steps``; the full tensors at each."""
    model, opt = _plain(**formats)
    states = {}
    done = 0
    with CheckpointManager(tmp_path, keep=keep) as manager:
        for step in steps:
            _train(model, opt, step - done, done + 1)
            done = step
            manager.save(step, model, opt, {**EXTRA, "step": step})
            states[step] = _full(model, opt)
    return states


def _step_dir(tmp_path: Path, step: int) -> Path:
    return tmp_path / CHECKPOINTS_DIR / f"step-{step}"


@pytest.mark.slow
def test_single_process_round_trip_and_layout(tmp_path):
    states = _saved_run(tmp_path, steps=(2,))
    path = _step_dir(tmp_path, 2)
    assert sorted(p.name for p in path.iterdir()) == [
        ".metadata",
        MARKER,
        "__0_0.distcp",
        "checkpoint.json",
        "rank-0.json",
    ]
    marker = json.loads((path / MARKER).read_text())
    assert marker["step"] == 2 and set(marker["files"]) == {
        ".metadata",
        "__0_0.distcp",
        "checkpoint.json",
        "rank-0.json",
    }
    manifest = json.loads((path / "checkpoint.json").read_text())
    assert manifest["model"]["preset"] == PRESET and manifest["model"]["vocab_size"] == VOCAB
    assert manifest["params"]["lm_head.weight"] == {
        "shape": [VOCAB, 128],
        "dtype": "float32",
        "m_format": "fp8",
        "v_format": "fp4_e2m2",
        "block_size": 32,
    }
    model, opt = _plain(seed=SEED + 1)
    assert load(path, model, opt) == {**EXTRA, "step": 2}
    _assert_bitwise(_full(model, opt), states[2])
    assert opt.take_stall_counts()[1] == 0  # loading leaves no stall counts behind


@pytest.mark.slow
def test_load_model_only(tmp_path):
    states = _saved_run(tmp_path, steps=(1,))
    model, _ = _plain(seed=SEED + 1)
    load(_step_dir(tmp_path, 1), model, None)
    manifest, tensors = read_full_model(_step_dir(tmp_path, 1))
    assert manifest["step"] == 1
    for name, p in model.named_parameters():
        assert torch.equal(p, states[1][f"param/{name}"]), name
        assert torch.equal(tensors[name], p), name


def test_checkpoint_before_the_first_step_has_no_optimizer_state(tmp_path):
    model, opt = _plain()
    with CheckpointManager(tmp_path, keep=1) as manager:
        manager.save(0, model, opt, {})
    assert not opt.state  # saving did not create the state
    fresh, fresh_opt = _plain(seed=SEED + 1)
    assert load(latest(tmp_path), fresh, fresh_opt) == {}
    assert not fresh_opt.state
    _assert_bitwise(_full(fresh, fresh_opt), _full(model, opt), with_state=False)


@pytest.mark.slow
def test_keep_prunes_the_oldest(tmp_path):
    _saved_run(tmp_path, steps=(1, 2, 3, 4), keep=2)
    assert sorted(p.name for p in (tmp_path / CHECKPOINTS_DIR).iterdir()) == ["step-3", "step-4"]
    assert latest(tmp_path) == _step_dir(tmp_path, 4)


@pytest.mark.slow
def test_saving_a_step_again_replaces_it(tmp_path):
    model, opt = _plain()
    _train(model, opt, 1)
    with CheckpointManager(tmp_path, keep=2) as manager:
        manager.save(1, model, opt, {"version": 1})
        _train(model, opt, 1, 2)
        manager.save(1, model, opt, {"version": 2})
    assert [p.name for p in (tmp_path / CHECKPOINTS_DIR).iterdir()] == ["step-1"]
    fresh, fresh_opt = _plain(seed=SEED + 1)
    assert load(_step_dir(tmp_path, 1), fresh, fresh_opt) == {"version": 2}
    _assert_bitwise(_full(fresh, fresh_opt), _full(model, opt))


@pytest.mark.slow
def test_latest_ignores_unfinished_saves(tmp_path):
    _saved_run(tmp_path, steps=(1,))
    (tmp_path / CHECKPOINTS_DIR / "step-3.tmp-0123abcd").mkdir()  # a save in progress
    unmarked = _step_dir(tmp_path, 2)
    unmarked.mkdir()  # no COMPLETE marker
    (unmarked / "checkpoint.json").write_text("{}")
    assert latest(tmp_path) == _step_dir(tmp_path, 1)
    assert resolve_resume(tmp_path, None) == _step_dir(tmp_path, 1)
    model, opt = _plain()
    assert load_latest_valid(tmp_path, model, opt)[0] == 1
    CheckpointManager(tmp_path, keep=1).close()  # rank 0 clears abandoned temporaries
    assert not (tmp_path / CHECKPOINTS_DIR / "step-3.tmp-0123abcd").exists()


_KILLED_SAVE = textwrap.dedent("""
    import sys, time
    import torch
    from torch.distributed.checkpoint import FileSystemWriter
    from srtrain.checkpoint import CheckpointManager
    from srtrain.models import build_model, init_weights
    from srtrain.optim import SRAdamW

    model = build_model("llama-tiny", 257, 16, device="cpu")
    init_weights(model, 0)
    opt = SRAdamW(model.parameters(), lr=1e-2, m_format="fp8", v_format="fp4_e2m2",
                  backend="torch")
    ids = torch.randint(0, 257, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    manager = CheckpointManager(sys.argv[1], keep=3)
    manager.save(1, model, opt, {"step": 1})
    finish = FileSystemWriter.finish

    def stalled(self, *args, **kwargs):
        print("WRITTEN", flush=True)  # data files are on disk, metadata and marker are not
        time.sleep(600)
        finish(self, *args, **kwargs)

    FileSystemWriter.finish = stalled
    manager.save(2, model, opt, {"step": 2})
""")


@pytest.mark.slow
def test_save_killed_midway_leaves_the_previous_checkpoint(tmp_path):
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_SAVE, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "WRITTEN"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    assert child.returncode == -signal.SIGKILL
    partial = [p for p in (tmp_path / CHECKPOINTS_DIR).iterdir() if ".tmp-" in p.name]
    assert len(partial) == 1 and (partial[0] / "__0_0.distcp").is_file()
    assert not (partial[0] / MARKER).exists()
    assert latest(tmp_path) == _step_dir(tmp_path, 1)
    model, opt = _plain()
    assert load_latest_valid(tmp_path, model, opt) == (1, {"step": 1})


def _corrupt(path: Path, how: str) -> None:
    data = path / "__0_0.distcp"
    if how == "truncated":
        with data.open("r+b") as f:
            f.truncate(data.stat().st_size - 100)
    elif how == "garbled":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    elif how == "missing":
        (path / "rank-0.json").unlink()
    elif how == "marker":
        (path / MARKER).write_text('{"format": "srtrain-checkpoint", "files": ')


@pytest.mark.slow
@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("truncated", r"__0_0\.distcp has \d+ bytes, the marker lists \d+ \(truncated"),
        ("garbled", r"__0_0\.distcp does not match its sha256 .* \(garbled\)"),
        ("missing", r"rank-0\.json is missing"),
        ("marker", r"COMPLETE is not valid JSON"),
    ],
)
def test_corrupt_checkpoint_errors_and_falls_back(tmp_path, how, message):
    states = _saved_run(tmp_path)
    newest = _step_dir(tmp_path, 2)
    _corrupt(newest, how)
    model, opt = _plain(seed=SEED + 1)
    before = _full(model, opt)
    with pytest.raises(CorruptCheckpointError, match=message) as error:
        load(newest, model, opt)
    assert "\n" not in str(error.value)
    _assert_bitwise(_full(model, opt), before, with_state=False)  # nothing was modified
    lines: list[str] = []
    step, extra = load_latest_valid(tmp_path, model, opt, log=lines.append)
    assert (step, extra["step"]) == (1, 1)
    assert len(lines) == 1 and re.fullmatch(
        f"checkpoint {re.escape(str(newest))} is corrupt \\(.*{message}.*\\); resuming from "
        "step-1 instead",
        lines[0],
    ), lines
    assert str(newest) not in lines[0].split("(", 1)[1]  # the reason names files relatively
    _assert_bitwise(_full(model, opt), states[1])
    assert latest(tmp_path) == (_step_dir(tmp_path, 1) if how == "marker" else newest)


@pytest.mark.slow
def test_no_usable_checkpoint_is_an_error_and_none_is_a_fresh_run(tmp_path):
    model, opt = _plain()
    assert load_latest_valid(tmp_path, model, opt) is None
    assert resolve_resume(tmp_path, "") is None
    _saved_run(tmp_path, steps=(1,))
    _corrupt(_step_dir(tmp_path, 1), "garbled")
    lines: list[str] = []
    with pytest.raises(
        CorruptCheckpointError,
        match=r"every checkpoint in .* is corrupt \(1; "
        r"step-1: checkpoint file __0_0\.distcp does not match its sha256",
    ):
        load_latest_valid(tmp_path, model, opt, log=lines.append)
    assert lines == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            dict(v_format="fp4_e2m2"),
            "has v_format fp8 but the run uses fp4_e2m2 (parameter model.embed_tokens.weight)",
        ),
        (dict(m_format="bf16"), "has m_format fp8 but the run uses bf16"),
        (dict(block_size=16), "has block_size 32 but the run uses 16"),
        (dict(preset="neox-tiny"), "has preset llama-tiny but the run uses neox-tiny"),
        (dict(vocab=300), "has vocab_size 257 but the run uses 300"),
    ],
)
def test_mismatched_run_is_refused_in_one_line(tmp_path, change, message):
    _saved_run(tmp_path, steps=(1,), v_format="fp8")
    model, opt = _plain(**{"v_format": "fp8", **change})
    with pytest.raises(CheckpointMismatchError) as error:
        load(_step_dir(tmp_path, 1), model, opt)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert not opt.state  # refused before anything was loaded


@pytest.mark.slow
def test_sradamw_checkpoint_is_refused_by_the_torch_adamw_baseline(tmp_path):
    """optim.name=torch_adamw keeps FP32 states under its own format name: a run switching
    optimizers is told so in one line, before anything loads."""
    from srtrain.optim.torch_adamw import TorchAdamW

    _saved_run(tmp_path, steps=(1,))
    model, _ = _plain()
    opt = TorchAdamW(model.parameters(), lr=1e-2)
    with pytest.raises(CheckpointMismatchError) as error:
        load(_step_dir(tmp_path, 1), model, opt)
    assert "has m_format fp8 but the run uses torch_adamw" in str(error.value)
    assert "\n" not in str(error.value) and not opt.state


@pytest.mark.slow
def test_changed_hyperparameters_warn_and_the_run_keeps_them(tmp_path):
    _saved_run(tmp_path, steps=(1,))
    model, _ = _plain()
    opt = SRAdamW(model.parameters(), lr=1e-2, backend="torch", seed=5, **FORMATS)
    with pytest.warns(UserWarning, match="optimizer group 0 seed=0, the run uses 5"):
        load(_step_dir(tmp_path, 1), model, opt)
    assert opt.param_groups[0]["seed"] == 5


@pytest.mark.slow
def test_async_save_publishes_and_loads(tmp_path):
    model, opt = _plain()
    _train(model, opt, 1)
    manager = CheckpointManager(tmp_path, keep=1, async_save=True)
    manager.save(1, model, opt, {"step": 1})
    at_save = _full(model, opt)
    _train(model, opt, 1, 2)
    manager.save(2, model, opt, {"step": 2})  # finishes the first save before starting
    assert manager.wait() == _step_dir(tmp_path, 2)
    assert manager.wait() is None
    manager.close()
    assert [p.name for p in (tmp_path / CHECKPOINTS_DIR).iterdir()] == ["step-2"]
    fresh, fresh_opt = _plain(seed=SEED + 1)
    assert load(latest(tmp_path), fresh, fresh_opt) == {"step": 2}
    _assert_bitwise(_full(fresh, fresh_opt), _full(model, opt))
    assert not torch.equal(
        at_save["param/lm_head.weight"], _full(model, opt)["param/lm_head.weight"]
    )


def test_extra_must_be_json(tmp_path):
    model, opt = _plain()
    with (
        CheckpointManager(tmp_path, keep=1) as manager,
        pytest.raises(TypeError, match=r"extra\['rng'\] is not a JSON value"),
    ):
        manager.save(1, model, opt, {"rng": torch.get_rng_state()})
    assert latest(tmp_path) is None


@pytest.mark.slow
def test_resolve_resume_prefers_the_explicit_path(tmp_path):
    _saved_run(tmp_path / "a", steps=(1, 2))
    _saved_run(tmp_path / "b", steps=(1,))
    assert resolve_resume(tmp_path / "b", str(_step_dir(tmp_path / "a", 1))) == _step_dir(
        tmp_path / "a", 1
    )
    assert resolve_resume(tmp_path / "b", tmp_path / "a") == _step_dir(tmp_path / "a", 2)
    assert resolve_resume(tmp_path / "b", None) == _step_dir(tmp_path / "b", 1)
    assert checkpoint_step(_step_dir(tmp_path / "a", 2)) == 2
    with pytest.raises(CheckpointError, match=r"checkpoint path '.*/missing' does not exist"):
        resolve_resume(tmp_path / "b", str(tmp_path / "missing"))
    with pytest.raises(CheckpointError, match="neither a complete checkpoint"):
        resolve_resume(tmp_path / "b", tmp_path)


class _Exploit:
    """Pickles to a call of os.system: what a hostile .metadata could hold."""

    def __init__(self, flag: Path) -> None:
        self.flag = flag

    def __reduce__(self):
        return os.system, (f"touch {self.flag}",)


def test_metadata_with_foreign_objects_is_refused(tmp_path):
    _saved_run(tmp_path, steps=(1,))
    path = _step_dir(tmp_path, 1)
    flag = tmp_path / "exploited"
    (path / ".metadata").write_bytes(pickle.dumps(_Exploit(flag)))
    marker = json.loads((path / MARKER).read_text())  # a forger updates the marker too
    marker["files"][".metadata"] = {
        "bytes": (path / ".metadata").stat().st_size,
        "sha256": hashlib.sha256((path / ".metadata").read_bytes()).hexdigest(),
    }
    (path / MARKER).write_text(json.dumps(marker))
    model, opt = _plain()
    with pytest.raises(CorruptCheckpointError, match=r"refers to (posix|os)\.system"):
        load(path, model, opt)
    assert not flag.exists()


def _manifest_without(path: Path, key: str) -> bytes:
    manifest = json.loads((path / "checkpoint.json").read_text())
    del manifest[key]
    return json.dumps(manifest).encode()


@pytest.mark.parametrize(
    ("forgery", "message"),
    [
        ("outside", r"points tensor data at '\.\./\.\./outside\.distcp', outside the checkpoint"),
        ("unlisted", r"points tensor data at 'extra\.distcp', which COMPLETE does not cover"),
        ("garbage", r"\.metadata is not DCP metadata \(UnpicklingError"),
        ("manifest", r"checkpoint manifest .*checkpoint\.json has no params"),
    ],
)
def test_forged_checkpoints_are_corrupt_and_fall_back(tmp_path, forgery, message):
    """Files whose hashes match the marker but whose content sends a load elsewhere, or
    cannot be read: corrupt, so the previous checkpoint is loaded with one line."""
    states = _saved_run(tmp_path)
    newest = _step_dir(tmp_path, 2)
    if forgery == "outside":  # the bytes loaded would be ones the marker does not cover
        (tmp_path / "outside.distcp").write_bytes((newest / "__0_0.distcp").read_bytes())
        forge(newest, ".metadata", metadata_pointing_at(newest, "../../outside.distcp"))
    elif forgery == "unlisted":
        (newest / "extra.distcp").write_bytes((newest / "__0_0.distcp").read_bytes())
        forge(newest, ".metadata", metadata_pointing_at(newest, "extra.distcp"))
    elif forgery == "garbage":
        forge(newest, ".metadata", b"\x80\x04garbage, not a pickle" * 8)
    else:
        forge(newest, "checkpoint.json", _manifest_without(newest, "params"))
    model, opt = _plain(seed=SEED + 1)
    with pytest.raises(CorruptCheckpointError, match=message) as error:
        load(newest, model, opt)
    assert "\n" not in str(error.value)
    lines: list[str] = []
    assert load_latest_valid(tmp_path, model, opt, log=lines.append)[0] == 1
    assert len(lines) == 1 and re.fullmatch(
        f"checkpoint {re.escape(str(newest))} is corrupt \\(.*{message}.*\\); resuming from "
        "step-1 instead",
        lines[0],
    ), lines
    _assert_bitwise(_full(model, opt), states[1])
    if forgery in ("outside", "unlisted"):
        with pytest.raises(CorruptCheckpointError, match=message):
            read_full_model(newest)


def test_a_step_dir_without_its_marker_is_named_and_pruned(tmp_path):
    _saved_run(tmp_path, steps=(1, 2, 3), keep=5)
    (_step_dir(tmp_path, 3) / MARKER).unlink()
    model, opt = _plain()
    lines: list[str] = []
    assert load_latest_valid(tmp_path, model, opt, log=lines.append)[0] == 2
    assert lines == [
        f"checkpoint {_step_dir(tmp_path, 3)} is corrupt (checkpoint marker COMPLETE is "
        "missing); resuming from step-2 instead"
    ]
    _train(model, opt, 1, 3)
    with CheckpointManager(tmp_path, keep=2) as manager:
        manager.save(4, model, opt, {"step": 4})
    assert sorted(p.name for p in (tmp_path / CHECKPOINTS_DIR).iterdir()) == ["step-2", "step-4"]
    (_step_dir(tmp_path, 2) / MARKER).unlink()  # no complete one left but the newest
    with pytest.raises(CorruptCheckpointError, match="step-4"):
        _corrupt(_step_dir(tmp_path, 4), "garbled")
        load_latest_valid(tmp_path, model, opt, log=lines.append)


@pytest.mark.parametrize(
    ("name", "held"),
    [
        ("model.safetensors", True),
        ("tokenizer/tokenizer.json", True),
        ("tokenizer/../outside", False),
        ("tokenizer/sub/file", False),
        ("other/file", False),
        ("../outside", False),
        ("/abs", False),
        ("", False),
    ],
)
def test_a_marker_names_files_inside_the_checkpoint_only(name, held):
    from srtrain.checkpoint import _is_checkpoint_file

    assert _is_checkpoint_file(name) is held
