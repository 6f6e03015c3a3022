"""Checkpoints: round trip, atomic writes, truncated files, a checkpoint from a different spec,
upgrading into a spec that adds parameters, and --strict."""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import titanc
from titanc.errors import TitancError
from titanc.runtime.train import checkpoint as ckpt_module
from titanc.runtime.train.checkpoint import (RNG_KEY, load_checkpoint, restore, save_checkpoint,
                                       spec_differences)
from titanc.runtime.train.trainer import Trainer
from titanc.model.spec import spec_hash, spec_to_dict

# one_thread is an autouse fixture
from .test_trainer import one_thread, tiny, train  # noqa: F401


def tokens(prog: Any, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (prog.batch_size, prog.seq_len + 1),
                         generator=torch.Generator().manual_seed(seed))


def snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


# --- writing and reading ---------------------------------------------------------------------


def test_round_trip(tmp_path: Path) -> None:
    prog = titanc.compile(tiny())
    prog.train_step(tokens(prog))
    rng = torch.Generator().manual_seed(5).get_state()
    path = save_checkpoint(tmp_path / "c.safetensors", prog, rng, extra={"tokens_seen": 32})
    tensors, meta = load_checkpoint(path)
    sd = prog.state_dict()
    assert set(tensors) == set(sd) | {RNG_KEY}
    assert all(torch.equal(tensors[k], sd[k]) for k in sd)
    assert torch.equal(tensors[RNG_KEY], rng)
    assert meta["step"] == 1 and meta["extra"] == {"tokens_seen": 32}
    assert meta["spec"] == spec_to_dict(prog.spec) and meta["spec_hash"] == spec_hash(prog.spec)
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]  # no temporary left over


def test_failed_write_keeps_the_old_checkpoint(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    prog = titanc.compile(tiny())
    path = save_checkpoint(tmp_path / "c.safetensors", prog)
    before = path.read_bytes()
    prog.train_step(tokens(prog))

    def disk_full(tensors: dict, filename: str, metadata: dict) -> None:
        save_file(tensors, filename, metadata)  # write the whole file, then keep only half
        with open(filename, "r+b") as f:
            f.truncate(len(Path(filename).read_bytes()) // 2)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt_module, "save_file", disk_full)
    with pytest.raises(TitancError) as e:
        save_checkpoint(path, prog)
    assert str(e.value) == (f"could not write checkpoint {path}: No space left on device; the "
                            f"previous checkpoint, if any, is unchanged")
    assert path.read_bytes() == before and load_checkpoint(path)[1]["step"] == 0
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]

    def interrupted(tensors: dict, filename: str, metadata: dict) -> None:
        Path(filename).write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt_module, "save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, prog)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]


def test_truncated_and_foreign_files(tmp_path: Path) -> None:
    prog = titanc.compile(tiny())
    path = save_checkpoint(tmp_path / "c.safetensors", prog)
    data = path.read_bytes()
    unreadable = (f"{path} is not a readable checkpoint (truncated or corrupt); resume from "
                  f"another copy or train from scratch")
    for cut in (len(data) // 2, 40, 3, 0):
        path.write_bytes(data[:cut])
        with pytest.raises(TitancError) as e:
            load_checkpoint(path)
        assert str(e.value) == unreadable
    path.write_bytes(b"\x00" * 8 + b"garbage" * 10)
    with pytest.raises(TitancError) as e:
        load_checkpoint(path)
    assert str(e.value) == unreadable
    save_file({"w": torch.zeros(2)}, str(path))
    with pytest.raises(TitancError) as e:
        load_checkpoint(path)
    assert str(e.value) == (f"{path} is a safetensors file but not a titanc checkpoint "
                            f"(no 'titanc-checkpoint' metadata)")
    with pytest.raises(TitancError) as e:
        load_checkpoint(tmp_path / "missing.safetensors")
    assert str(e.value) == f"checkpoint {tmp_path / 'missing.safetensors'} does not exist"


def test_truncated_checkpoint_on_resume_overwrites_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(tiny(), run, steps=1)
    ckpt = run / "checkpoint.safetensors"
    ckpt.write_bytes(ckpt.read_bytes()[:100])
    before = snapshot(run)
    with pytest.raises(TitancError) as e:
        train(tiny(), run, steps=2, resume=run)
    assert str(e.value).startswith(f"{ckpt} is not a readable checkpoint (truncated or corrupt)")
    assert snapshot(run) == before


# --- comparing specs -------------------------------------------------------------------------


def test_spec_differences_ignore_run_control() -> None:
    a = spec_to_dict(tiny())
    b = spec_to_dict(tiny(train__steps=999, train__eval_every=7, name="other",
                          model__memory__adaptive=False, train__lr=1e-4))
    assert spec_differences(a, b) == [("model.memory.adaptive", True, False),
                                      ("train.lr", 0.003, 1e-4)]


def test_different_model_names_fields_and_overwrites_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(tiny("lmm"), run, steps=1)
    ckpt = run / "checkpoint.safetensors"
    before = snapshot(run)
    with pytest.raises(TitancError) as e:
        train(tiny("lmm", model__d_model=32), run, steps=2, resume=run)
    assert str(e.value) == (
        f"checkpoint {ckpt} does not fit the spec: tensor param.embed has shape [256, 16] in the "
        f"checkpoint and [256, 32] in the spec (the checkpoint's spec differs in model.d_model "
        f"(checkpoint 16, spec 32)); resume with the spec it was trained with (spec.yaml in its "
        f"run directory) or train from scratch into a new --out")
    with pytest.raises(TitancError) as e:
        train(tiny("attn"), tmp_path / "other", steps=2, resume=run)
    assert str(e.value) == (
        f"checkpoint {ckpt} is from a different model: 51 of its tensors have no place in this "
        f"spec (param.layers.mem_alpha_b, param.layers.mem_alpha_w, param.layers.mem_conv_k, "
        f"param.layers.mem_conv_q and 47 more; the checkpoint's spec differs in model.block "
        f"(checkpoint lmm, spec attn)); only upgrades that add parameters can resume; resume "
        f"with the spec it was trained with (spec.yaml in its run directory) or train from "
        f"scratch into a new --out")
    assert snapshot(run) == before and not (tmp_path / "other").exists()


# --- upgrading ---------------------------------------------------------------------------------


def test_upgrade_adds_adaptive_gates(tmp_path: Path) -> None:
    old, new = tiny("lmm", model__memory__adaptive=False), tiny("lmm")
    run = tmp_path / "run"
    train(old, run, steps=2)
    tensors, _ = load_checkpoint(run / "checkpoint.safetensors")
    logs: list[str] = []
    t = Trainer(new, tmp_path / "up", steps=4, resume=run, progress=False, log=logs.append)
    gates = [f"layers.mem_{g}_{p}" for g in ("theta", "eta", "alpha") for p in ("w", "b")]
    assert sorted(t.restored["new"]) == sorted(gates)
    assert t.restored["model_changes"] == [("model.memory.adaptive", False, True)]
    sd, fresh = t.prog.state_dict(), titanc.compile(new).state_dict()
    for k, v in sd.items():
        if k in tensors:  # every shared tensor bit-identical to the checkpoint
            assert torch.equal(v, tensors[k]), k
        else:  # every new one exactly as a fresh model initialises it
            assert torch.equal(v, fresh[k]), k
    assert t.prog.step == 2
    summary = t.run()
    assert summary["steps"] == 4 and summary["new_parameters"] == t.restored["new"]
    assert any(line.startswith("  new parameters (fresh initialisation): layers.mem_")
               for line in logs)
    assert any("model.memory.adaptive: False in the checkpoint, True now" in line for line in logs)
    after, _ = load_checkpoint(tmp_path / "up" / "checkpoint.safetensors")
    assert not torch.equal(after["param.layers.mem_theta_w"], fresh["param.layers.mem_theta_w"])


def test_strict_refuses_any_difference(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(tiny("lmm", model__memory__output_gate=False), run, steps=1)
    ckpt = run / "checkpoint.safetensors"
    with pytest.raises(TitancError) as e:
        Trainer(tiny("lmm"), tmp_path / "b", steps=2, resume=run, strict=True)
    assert str(e.value) == (
        f"checkpoint {ckpt} differs from the spec in model.memory.output_gate (checkpoint false, "
        f"spec true); --strict refuses any difference: drop --strict to load the matching "
        f"tensors and initialise the new ones (layers.mem_wg)")
    with pytest.raises(TitancError) as e:  # a training field counts as a difference too
        Trainer(tiny("lmm", model__memory__output_gate=False, train__lr=1e-3), tmp_path / "b",
                steps=2, resume=run, strict=True)
    assert str(e.value) == (
        f"checkpoint {ckpt} differs from the spec in train.lr (checkpoint 0.003, spec 0.001); "
        f"--strict refuses any difference: drop --strict to resume anyway")
    # without --strict both resume; with the spec unchanged (but for --steps) so does --strict
    assert Trainer(tiny("lmm"), tmp_path / "b", steps=2, resume=run).restored["new"] == [
        "layers.mem_wg"]
    same = Trainer(tiny("lmm", model__memory__output_gate=False), tmp_path / "b", steps=2,
                   resume=run, strict=True)
    assert same.restored == {"new": [], "model_changes": [], "train_changes": [], "step": 1}


def test_restore_checks_before_touching_the_program(tmp_path: Path) -> None:
    small = titanc.compile(tiny())
    path = save_checkpoint(tmp_path / "c.safetensors", small)
    tensors, meta = load_checkpoint(path)
    big = titanc.compile(tiny(model__d_model=32))
    before = {k: v.clone() for k, v in big.state_dict().items()}
    with pytest.raises(TitancError):
        restore(big, tensors, meta, path=path)
    assert all(torch.equal(v, before[k]) for k, v in big.state_dict().items())
    assert json.loads(json.dumps(meta["spec"])) == spec_to_dict(small.spec)
