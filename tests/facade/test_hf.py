"""``ZeroTrainer`` and the ``accelerate`` recipe against ``Trainer``/``accelerate`` + AdamW under DDP.

All runs go through one ``torchrun --nproc-per-node 2`` launch of ``hf_runs.py``
(gloo, a tiny random GPT-2, no downloads); see that file for the runs. Without
clipping the reduction order is DDP's (per-bucket sum of two ranks, then
divided by a power of two), so fp32 runs are bit-identical. With clipping the
global norm is summed in another order (per shard rather than per parameter),
which moves it by about 5e-7 relative; Adam then amplifies that rounding on
the few elements whose exact gradient is zero (the key biases of attention),
so those runs agree within 1e-6.

At stage 3 (``zero3*`` runs) ``ZeroTrainer`` attaches the model and saves and
loads the model's weights gathered on every rank: the same comparisons hold, the
saved ``model.safetensors`` is the gathered model, a run resumed with
``resume_from_checkpoint=True`` continues exactly and ``load_best_model_at_end``
writes the best checkpoint's weights back into the shards.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
from hf_launch import launch_hf_runs

TOL = 1e-6
HAS_HF = all(importlib.util.find_spec(m) is not None for m in ("transformers", "accelerate"))
pytestmark = pytest.mark.skipif(not HAS_HF, reason="needs transformers and accelerate (pip install '.[hf]')")

RUNS = (
    "ddp", "zero", "ddp_gas", "zero_gas", "ddp_clip", "zero_clip", "zero1_clip", "zero_clip_resumed",
    "zero_bf16", "zero_bf16_background", "zero_bf16_resumed", "accelerate_ddp", "accelerate_zero",
    "accelerate_ddp_clip", "accelerate_zero_clip", "ERROR_plain_trainer", "zero3", "zero3_clip",
    "zero3_clip_resumed", "zero3_best", "zero_background_rotation", "ERROR_background_failure",
    "zero_background_failure_resumed", "ddp_buffers", "zero_buffers",
)  # fmt: skip


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[dict[str, Any]]]:
    """Every run of ``hf_runs.py``, per rank (one torchrun launch)."""
    import torch

    out = tmp_path_factory.mktemp("hf")
    launch_hf_runs(out, RUNS)
    loaded = {
        name: [torch.load(out / f"{name}.rank{r}.pt", weights_only=False) for r in range(2)] for name in RUNS
    }
    loaded["_dir"] = out  # type: ignore[assignment]
    return loaded


def _max_abs(a: dict[str, Any], b: dict[str, Any]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(("ours", "theirs"), [("zero", "ddp"), ("zero_gas", "ddp_gas"), ("zero3", "ddp"),
                                              ("accelerate_zero", "accelerate_ddp")])  # fmt: skip
def test_fp32_training_is_bit_identical_to_ddp_with_adamw(results, ours, theirs):
    mine, ref = results[ours][0], results[theirs][0]
    assert len(mine["losses"]) == 6
    assert mine["losses"] == ref["losses"]
    assert _max_abs(mine["params"], ref["params"]) == 0.0
    # The logged norm is opt.grad_norm() (Trainer: clip_grad_norm_(params, inf) on the DDP model).
    assert _rel(mine["grad_norms"], ref["grad_norms"]) <= TOL


@pytest.mark.parametrize(("ours", "theirs"), [("zero_clip", "ddp_clip"), ("zero1_clip", "ddp_clip"),
                                              ("zero3_clip", "ddp_clip"), ("zero3_clip", "zero_clip"),
                                              ("accelerate_zero_clip", "accelerate_ddp_clip")])  # fmt: skip
def test_clipping_and_accumulation_match_ddp_with_adamw(results, ours, theirs):
    mine, ref = results[ours][0], results[theirs][0]
    assert len(mine["losses"]) == 6
    assert max(abs(x - y) for x, y in zip(mine["losses"], ref["losses"], strict=True)) <= TOL
    assert _rel(mine["grad_norms"], ref["grad_norms"]) <= TOL  # pre-clip norms, > 0.5: clipping was active
    assert min(ref["grad_norms"]) > 0.5
    # Clipping scales by max_norm / norm, and zeroplan's norm sums its squares per shard where DDP's
    # (torch's clip_grad_norm_) takes per-tensor norms first: the last bits of the scale differ, and
    # six clipped steps carry that into the parameters. Without clipping the runs are bit-identical
    # (above). Measured: stage 3 against stage 2 1.0075e-6 with transformers 5.23; against DDP
    # 1.18e-6 (stages 1, 3, accelerate) and 1.16e-6 with transformers 5.24.0, the same with the code
    # before this change: 2 TOL for every pair.
    assert _max_abs(mine["params"], ref["params"]) <= 2 * TOL
    if mine.get("eval_losses"):
        assert max(abs(x - y) for x, y in zip(mine["eval_losses"], ref["eval_losses"], strict=True)) <= TOL


def test_buffers_are_copied_from_rank_zero_where_ddp_copies_them(results):
    """Each rank's running statistics and the eval losses equal DDP's with 3 micro-batches a step: rank
    0's buffers reach the others before a step's first micro-batch only (after a synchronised
    backward), not before every micro-batch."""
    for rank in range(2):
        mine, ref = results["zero_buffers"][rank], results["ddp_buffers"][rank]
        assert mine["eval_losses"] == ref["eval_losses"] and len(ref["eval_losses"]) == 3, (mine, ref)
        assert _max_abs(mine["buffers"], ref["buffers"]) == 0.0, rank
        assert _max_abs(mine["params"], ref["params"]) == 0.0, rank
    ranks = results["ddp_buffers"]  # the ranks' own batches since the last copy: their statistics differ
    assert _max_abs(ranks[0]["buffers"], ranks[1]["buffers"]) > 0


@pytest.mark.parametrize("run", ["zero_clip", "zero_bf16", "zero3_clip"])
def test_resume_from_a_trainer_checkpoint_equals_the_uninterrupted_run(results, run):
    uninterrupted, resumed = results[run], results[f"{run}_resumed"]
    for rank in range(2):
        assert resumed[rank]["steps"] == [1, 2, 3, 4, 5, 6]  # 1-3 from the checkpoint's trainer state
        assert resumed[rank]["losses"][3:] == uninterrupted[rank]["losses"][3:]
        assert resumed[rank]["grad_norms"][3:] == uninterrupted[rank]["grad_norms"][3:]
        assert _max_abs(resumed[rank]["params"], uninterrupted[rank]["params"]) == 0.0
    folder = results["_dir"] / run / "checkpoint-3"
    assert (folder / "zeroplan" / "latest").is_file() and (folder / "scheduler.pt").is_file()
    assert not (folder / "optimizer.pt").exists()


def test_background_saves_change_no_result_and_write_the_same_checkpoints(results):
    """``ZeroTrainer(background_saves=True)``: the run and its checkpoint equal the blocking run's."""
    import optree
    import torch

    for rank in range(2):
        plain, background = results["zero_bf16"][rank], results["zero_bf16_background"][rank]
        assert plain["losses"] == background["losses"] and plain["grad_norms"] == background["grad_norms"]
        assert _max_abs(plain["params"], background["params"]) == 0.0
    for shard in ("shard-00000.pt", "shard-00001.pt"):
        a, b = (
            torch.load(results["_dir"] / run / "checkpoint-3" / "zeroplan" / "snapshot-00000001" / shard)
            for run in ("zero_bf16", "zero_bf16_background")
        )
        assert a.keys() == b.keys() and optree.tree_structure(a) == optree.tree_structure(b)
        leaves = zip(optree.tree_leaves(a), optree.tree_leaves(b), strict=True)
        assert all(torch.equal(x, y) if torch.is_tensor(x) else x == y for x, y in leaves), shard


def test_background_saves_delete_older_checkpoints_only_once_the_newer_one_committed(results):
    """[Note: background saves and rotation]: with ``save_total_limit=1`` the previous checkpoint stays
    while the newer one's optimizer is written, and goes once it committed."""
    for rank in range(2):
        r = results["zero_background_rotation"][rank]
        assert r["steps"] == list(range(1, 7)), r["steps"]
        # right after checkpoint-4's save returned, its optimizer still being written
        assert r["at_save"][4] == {"checkpoint-2": True, "checkpoint-4": False}, r["at_save"]
        assert r["at_end"] == {"checkpoint-6": True}, r["at_end"]


def test_a_failed_background_save_raises_on_every_rank_and_leaves_the_previous_checkpoint(results):
    for rank in range(2):
        error = results["ERROR_background_failure"][rank]["error"]
        assert error.startswith("CheckpointError") and "No space left on device" in error, error
    resumed = results["zero_background_failure_resumed"]
    for rank in range(2):
        r = resumed[rank]
        # checkpoint-4's optimizer never committed; checkpoint-2 was kept, complete
        assert r["before"] == {"checkpoint-2": True, "checkpoint-4": False}, r["before"]
        # resume_from_checkpoint=True passes over checkpoint-4 and continues from checkpoint-2
        assert r["steps"] == list(range(1, 7)), r["steps"]
        whole = results["zero_background_rotation"][rank]
        assert r["losses"] == whole["losses"]
        assert _max_abs(r["params"], whole["params"]) == 0.0


def _saved_model(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def test_stage_3_saves_the_gathered_model(results):
    final = results["zero3_clip"][0]["params"]
    saved = _saved_model(results["_dir"] / "zero3_clip" / "checkpoint-6")
    assert "lm_head.weight" not in final  # tied to transformer.wte.weight: one parameter
    assert saved.keys() == final.keys()
    assert _max_abs(saved, final) == 0.0
    # checkpoint-3 holds the same model as stage 2's (the clipping norm is summed in another order)
    stage2 = _saved_model(results["_dir"] / "zero_clip" / "checkpoint-3")
    assert _max_abs(_saved_model(results["_dir"] / "zero3_clip" / "checkpoint-3"), stage2) <= TOL


def test_stage_3_load_best_model_at_end_writes_the_best_weights_into_the_shards(results):
    best = results["_dir"] / "zero3_best" / "checkpoint-3"
    saved = _saved_model(best)
    for rank in range(2):
        run = results["zero3_best"][rank]
        assert run["best"] == str(best)  # the higher eval loss: not the weights training ended with
        assert _max_abs(run["params"], saved) == 0.0
        assert _max_abs(results["zero3_clip"][rank]["params"], saved) > 1e-3


def test_every_rank_ends_with_the_same_unwrapped_model(results):
    names = ("zero", "zero_gas", "zero_clip", "zero1_clip", "zero_bf16", "accelerate_zero_clip", "zero3_clip")
    for name in names:
        assert _max_abs(results[name][0]["params"], results[name][1]["params"]) == 0.0, name
    for name in ("zero", "zero_clip", "zero_bf16_resumed", "zero3_clip_resumed"):
        assert results[name][0]["wrapped"] == "GPT2LMHeadModel", name
    assert results["ddp"][0]["wrapped"] == "DistributedDataParallel"


def test_plain_trainer_with_zero_optimizer_fails_and_names_zero_trainer(results):
    for rank in range(2):
        error = results["ERROR_plain_trainer"][rank].get("error")
        assert error is not None, results["ERROR_plain_trainer"][rank]
        assert error.startswith("ConfigError") and "ZeroTrainer" in error, error


# --------------------------------------------------------------------------- in this process
@pytest.fixture(scope="module")
def hf():
    import torch
    from transformers import TrainingArguments

    from zeroplan.facade import hf as module

    def args(tmp_path: Path, **kw: Any) -> TrainingArguments:
        return TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **kw)

    return module, args, torch


def test_zero_trainer_refuses_what_cannot_work(hf, tmp_path):
    module, args, torch = hf
    from zeroplan.core import ConfigError

    model = torch.nn.Linear(3, 3)
    cases = [
        ({"optimizers": (torch.optim.SGD(model.parameters()), None)}, "ZeroTrainer builds its ZeroOptimizer"),
        ({"zero_kwargs": {"loss_scale": "dynamic"}}, "applies no loss scale"),
        ({"zero_kwargs": {"lr": 1.0}}, "not ZeroOptimizer settings"),
        ({"zero_kwargs": {"deterministic": True}}, "does not take 'deterministic': it needs a power of two"),
        ({"zero_kwargs": {"device_mesh": None}}, "does not take 'device_mesh': Trainer shards the data"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ConfigError, match=message):
            module.ZeroTrainer(model=model, args=args(tmp_path), **kwargs)
    settings = {"ranks_per_node": 1, "layout": "auto", "reduce_dtype": "bf16", "gather_dtype": "bf16"}
    settings |= {"wire_block": 64, "overlap_param_gather": False, "strict_memory": False}
    module.ZeroTrainer(model=model, args=args(tmp_path), zero_kwargs=settings)  # passed on
    trainer = module.ZeroTrainer(
        model=model, args=args(tmp_path), optimizer_cls_and_kwargs=(torch.optim.AdamW, {"optimizer_dict": {}})
    )
    with pytest.raises(ConfigError, match="builds it from the model itself"):
        trainer.create_optimizer()
    with pytest.raises(ConfigError, match="built by train"):
        trainer.zero_optimizer  # noqa: B018
