"""``zeroplan export`` and ``zeroplan inspect``: checkpoints read offline, in this one process.

The checkpoints are saved by ``scenarios_export.py`` in the gloo worker pools (world 2, and
world 4 with expert groups); export and inspect then run here, with no process group, and
their output is compared bit for bit with what the live run gathered. ``ZeroTrainer``
checkpoints exported load with ``from_pretrained`` (``test_trainer_checkpoints_export_...``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import scenarios_export
import torch
from checkpoint_damage import flip_tensor_byte, snapshot_of

from zeroplan.core import ConfigError
from zeroplan.facade.checkpoint.export import export
from zeroplan.facade.checkpoint.manifest import seal
from zeroplan.facade.cli import main

HERE = Path(__file__).resolve().parent
HAS_HF = all(importlib.util.find_spec(m) is not None for m in ("transformers", "accelerate", "safetensors"))
needs_safetensors = pytest.mark.skipif(
    importlib.util.find_spec("safetensors") is None, reason="reads with safetensors"
)

CONFIGS = {
    "stage2": {"stage": 2},
    "stage3_bf16": {"stage": 3, "dtype": "bf16"},
    "rank_major_shard1_frozen": {"stage": 2, "layout": "rank_major", "shard": 1, "frozen": True},
    "stage1_bf16_rank_major": {"stage": 1, "dtype": "bf16", "layout": "rank_major"},
}


@pytest.fixture(scope="module")
def saved(pools, tmp_path_factory) -> dict[str, tuple[Path, dict[str, Any]]]:
    """Each configuration's checkpoint root and what its live run gathered (rank 0)."""
    out = {}
    for name, cfg in CONFIGS.items():
        root = tmp_path_factory.mktemp("ckpt") / name
        live = pools(2).run(scenarios_export.train_and_save, cfg, str(root))[0]
        out[name] = (root, live)
    return out


def _read(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an export directory (safetensors or torch, one file or split)."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(out.iterdir()):
        if path.suffix == ".safetensors":
            part = load_file(path)
        elif path.suffix == ".bin":
            part = torch.load(path, weights_only=True)
        else:
            continue
        assert not part.keys() & tensors.keys()
        tensors.update(part)
    return tensors


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _fails(capsys, *argv: str) -> str:
    """Run the CLI expecting exit code 2; its one stderr line."""
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("zeroplan: error: "), err
    assert "Traceback" not in err
    return err


# --------------------------------------------------------------------------- export
@needs_safetensors
@pytest.mark.parametrize("name", list(CONFIGS))
def test_export_equals_the_live_gathered_weights(saved, tmp_path, name):
    root, live = saved[name]
    out = tmp_path / "out"
    assert main(["export", str(root), str(out)]) == 0
    assert sorted(os.listdir(out)) == ["model.safetensors"]
    assert _equal(_read(out), live["params"])


@needs_safetensors
@pytest.mark.parametrize("name", list(CONFIGS))
def test_export_fp32_writes_the_masters(saved, tmp_path, name):
    root, live = saved[name]
    out = tmp_path / "out"
    assert main(["export", str(root), str(out), "--dtype", "fp32"]) == 0
    exported = _read(out)
    assert all(t.dtype == torch.float32 for t in exported.values())
    # bf16 parameters: their separate fp32 masters; fp32 (and frozen) ones are their own masters.
    expected = {n: live["masters"].get(n, p.float()) for n, p in live["params"].items()}
    if "bf16" in name:
        assert live["masters"].keys() == live["params"].keys()
        assert not _equal(exported, {n: p.float() for n, p in live["params"].items()})  # not cast up
    assert _equal(exported, expected)


@needs_safetensors
def test_export_splits_above_the_cap_with_an_index(saved, tmp_path):
    root, live = saved["stage3_bf16"]
    out = tmp_path / "out"
    assert main(["export", str(root), str(out), "--max-shard-size", "4KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert (
        set(index["weight_map"].values()) == set(files)
        and index["weight_map"].keys() == live["params"].keys()
    )
    assert index["metadata"]["total_size"] == sum(
        p.numel() * p.element_size() for p in live["params"].values()
    )
    biggest = max(p.numel() * p.element_size() for p in live["params"].values())
    assert all((out / f).stat().st_size <= max(4000, biggest) + 2000 for f in files)  # + header
    assert _equal(_read(out), live["params"])


@needs_safetensors
def test_export_torch_format(saved, tmp_path):
    root, live = saved["rank_major_shard1_frozen"]
    out = tmp_path / "out"
    assert main(["export", str(root), str(out), "--format", "torch"]) == 0
    assert sorted(os.listdir(out)) == ["pytorch_model.bin"]
    assert _equal(torch.load(out / "pytorch_model.bin", weights_only=True), live["params"])
    split = tmp_path / "split"
    assert main(["export", str(root), str(split), "--format", "torch", "--max-shard-size", "8KiB"]) == 0
    assert (split / "pytorch_model.bin.index.json").is_file()
    assert _equal(_read(split), live["params"])


@needs_safetensors
def test_export_with_expert_groups(pools, tmp_path):
    root = tmp_path / "ckpt"
    ranks = pools(4).run(scenarios_export.experts_saved, str(root))
    out = tmp_path / "out"
    assert main(["export", str(root), str(out)]) == 0
    exported = _read(out)
    dense = {f"group0.param{i}": p for i, p in enumerate(ranks[0]["dense"])}
    # Unnamed, the expert domain's parameters are group0.param<i> in both expert groups (and in the
    # data domain): told apart by their group, by ranks [0, 2] and [1, 3], each holding its experts once.
    experts = {
        f"experts.group{k}.group0.param{i}": p for k in range(2) for i, p in enumerate(ranks[k]["experts"])
    }
    assert _equal(exported, dense | experts)


# --------------------------------------------------------------------------- inspect
def test_inspect_describes_and_verifies(saved, capsys):
    root, live = saved["stage3_bf16"]
    assert main(["inspect", str(root)]) == 0
    text = capsys.readouterr().out
    for expected in ("zeroplan.checkpoint/v3", "world 2, shard size 2, stage 3", "AdamW, step 3", "verified"):
        assert expected in text, text
    assert main(["inspect", str(root), "--json"]) == 0
    described = json.loads(capsys.readouterr().out)
    numel = sum(p.numel() for p in live["params"].values())
    assert described["parameters"]["count"] == len(live["params"])
    assert described["parameters"]["elements"] == numel
    assert (described["world_size"], described["shard_size"], described["stage"]) == (2, 2, 3)
    assert described["optimizer"] == "AdamW" and described["step"] == 3
    assert described["separate_master"] == ["bfloat16"]
    on_disk = sum(p.stat().st_size for p in snapshot_of(root).iterdir())
    assert described["bytes"] == on_disk
    assert described["verified_bytes"] > numel * 2  # parameters, masters and state, every block


# --------------------------------------------------------------------------- bad input
@pytest.fixture
def damaged(saved, tmp_path):
    """A fresh copy of a checkpoint to damage."""
    import shutil

    root = tmp_path / "ckpt"
    shutil.copytree(saved["stage2"][0], root)
    return root


def test_export_into_a_non_empty_directory_is_refused_and_writes_nothing(saved, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    err = _fails(capsys, "export", str(saved["stage2"][0]), str(out))
    assert "not an empty directory" in err
    assert os.listdir(out) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"


def test_export_of_one_tensor_parallel_slice_is_refused_and_writes_nothing(pools, tmp_path, capsys):
    """A tp slice's root holds its local tensors under the global names: exporting it would write
    them as the model's weights (a (4, 4) slice as the (8, 4) "0.weight")."""
    pools(2).run(scenarios_export.tensor_slices_saved, str(tmp_path / "ckpt"))
    for t in range(2):
        out = tmp_path / f"out{t}"
        err = _fails(capsys, "export", str(tmp_path / "ckpt" / f"tp{t}"), str(out))
        assert f"was saved by tp slice {t} of 2" in err and "checkpoint.load(opt, [" in err, err
        assert not out.exists()
    with pytest.raises(ConfigError, match="local tensors under the global parameter names"):
        export(tmp_path / "ckpt" / "tp0", tmp_path / "out")
    assert main(["inspect", str(tmp_path / "ckpt" / "tp1")]) == 0  # inspecting it is fine


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("missing", "is missing"),
        ("truncated", "truncated"),
        ("checksum", "checksum mismatch"),
        ("newer", "newer zeroplan"),
        ("not_ours", "no zeroplan checkpoint"),
        ("edited", "does not match its digest"),
    ],
)
def test_bad_checkpoints_are_one_line_and_exit_2(damaged, tmp_path, capsys, damage, message):
    snapshot = snapshot_of(damaged)
    target = damaged
    if damage == "missing":
        (snapshot / "shard-00001.pt").unlink()
    elif damage == "truncated":
        data = (snapshot / "shard-00000.pt").read_bytes()
        (snapshot / "shard-00000.pt").write_bytes(data[: len(data) // 2])
    elif damage == "checksum":
        flip_tensor_byte(snapshot / "shard-00001.pt")
    elif damage in ("newer", "edited"):
        document = json.loads((snapshot / "manifest.json").read_text())
        if damage == "newer":
            document = seal({**document, "format": "zeroplan.checkpoint/v4"})
        else:
            document["stage"] = 1
        (snapshot / "manifest.json").write_text(json.dumps(document))
    else:
        target = tmp_path / "nothing"
        target.mkdir()
    assert message in _fails(capsys, "inspect", str(target))
    out = tmp_path / "out"
    assert message in _fails(capsys, "export", str(target), str(out))
    assert not out.exists()  # nothing written, no directory left behind


def test_the_console_script_prints_one_line_for_a_missing_checkpoint(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "zeroplan.facade.cli", "inspect", str(tmp_path / "absent")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "does not exist" in done.stderr and not done.stdout


def test_bad_shard_size_is_one_line(saved, tmp_path, capsys):
    assert "no size" in _fails(
        capsys, "export", str(saved["stage2"][0]), str(tmp_path / "o"), "--max-shard-size", "5 parsecs"
    )


# --------------------------------------------------------------------------- memory
def _export_peak(root: Path, out: Path, *argv: str) -> int:
    """Tensor bytes ``zeroplan export`` holds at its peak beyond the memory-mapped checkpoint files.

    Torch's ``MemTracker`` counts a memory-mapped file's tensor storages once each, whole, from
    the first view taken of them: file pages the kernel may drop, not memory the export holds.
    Their bytes are subtracted; what remains is what the export allocated.
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    from zeroplan.facade.checkpoint.export import Snapshot
    from zeroplan.facade.diagnostics.meter import tracked_bytes
    from zeroplan.facade.mechanisms.torch_dtypes import torch_dtype

    snapshot = Snapshot(root)
    mapped = 0
    for listed in snapshot.manifest.files:
        file = snapshot.open(listed.name)
        for name in file.names():
            meta = file.meta(name)
            mapped += torch.Size(meta.shape).numel() * torch_dtype(meta.dtype).itemsize
    tracker = MemTracker()
    with tracker:
        assert main(["export", str(root), str(out), *argv]) == 0
        return tracked_bytes(tracker, "peak") - mapped


@needs_safetensors
def test_export_holds_at_most_about_the_largest_tensor(pools, tmp_path):
    root = tmp_path / "ckpt"
    pools(2).run(scenarios_export.large_and_small, str(root))
    largest, whole = 1024 * 1024 * 4, 8 * 1024 * 1024 * 4  # eight 4 MB tensors
    peaks = {
        "safetensors": _export_peak(root, tmp_path / "a"),
        "fp32": _export_peak(root, tmp_path / "b", "--dtype", "fp32"),
        "torch, 5 MB files": _export_peak(
            root, tmp_path / "c", "--format", "torch", "--max-shard-size", "5MB"
        ),
        "torch, one file": _export_peak(root, tmp_path / "d", "--format", "torch"),
    }
    assert peaks["safetensors"] <= largest + (1 << 20), peaks
    assert peaks["fp32"] <= largest + (1 << 20), peaks
    assert peaks["torch, 5 MB files"] <= largest + (1 << 20), peaks  # one file's tensors: one here
    assert peaks["torch, one file"] >= whole, peaks  # the measure sees a whole model held
    assert _equal(_read(tmp_path / "a"), _read(tmp_path / "c"))


#: Runs its arguments as a command and prints the command's peak resident bytes (ru_maxrss is in KiB
#: on Linux). A child's ru_maxrss is at least its parent's peak (the kernel counts the memory it was
#: started from, the parent's, when it execs): the command starts from this small interpreter, not
#: from the large one measuring, whose peak would hide the import baseline.
_PEAK_OF = """
import resource, subprocess, sys
subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
"""
#: Imports the CLI, then runs ``zeroplan export`` with its arguments if it has any.
_EXPORT = """
import sys
import zeroplan.facade.checkpoint.export
from zeroplan.facade.cli import main
sys.exit(main(["export", *sys.argv[1:]]) if sys.argv[1:] else 0)
"""


def _peak_resident(*argv: str) -> int:
    """Peak resident bytes of a fresh interpreter that imports the CLI and runs ``export *argv``.

    ``RUSAGE_CHILDREN`` of the small interpreter that starts it (see ``_PEAK_OF``): its only child.
    """
    done = subprocess.run(
        [sys.executable, "-c", _PEAK_OF, sys.executable, "-c", _EXPORT, *argv],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return int(done.stdout.split()[-1])


@needs_safetensors
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mapped pages are released on Linux")
def test_export_keeps_about_one_tensor_resident_above_the_import(pools, tmp_path):
    """[Note: mapped pages]: 256 MiB of weights exported hold one 64 MiB tensor's pages at a time.

    Before the pages were released, the peak rose by every page read: the whole 256 MiB.
    """
    root = tmp_path / "ckpt"
    pools(2).run(scenarios_export.large_fp32, str(root))
    largest = scenarios_export.LARGE_IN * scenarios_export.LARGE_OUT * 4
    whole = scenarios_export.LARGE_LAYERS * (largest + scenarios_export.LARGE_OUT * 4)
    baseline = _peak_resident()
    exported = _peak_resident(str(root), str(tmp_path / "out"))
    margin = 32 << 20  # manifest, checksums, allocator: measured 10 MiB above the tensor here
    assert (tmp_path / "out" / "model.safetensors").stat().st_size > whole
    assert exported - baseline <= largest + margin, (exported - baseline, largest, whole)
