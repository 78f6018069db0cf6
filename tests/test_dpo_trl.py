"""``train.objective=dpo`` against TRL's ``DPOTrainer`` (PyTorch): the same tiny Llama (built by
transformers, imported with ``convert from-hf``) and the same preference records give

- the same tokens and answer masks (jaxdist's ``data.source=preference`` rows against TRL's
  collated batch: prompt and answer tokenised apart, the end-of-text id closing each answer);
- at step 1 (the policy equal to the reference) TRL's loss, and TRL's gradients within 1e-4,
  read from jaxdist's step-1 checkpoint exported with ``convert to-hf`` (plain SGD: the weights
  moved by the learning rate times the gradient);
- at step 2, after the same SGD step on both sides, TRL's loss and its four reward metrics
  (``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``)
  within 1e-5, for the sigmoid loss and for IPO.

Needs the ``hf`` extra (torch, transformers) and TRL; without them the module skips in one line.
Nothing is downloaded."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'jaxdist[hf]')")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'jaxdist[hf]')")
trl = pytest.importorskip("trl", reason="TRL is not installed (pip install trl)")
datasets = pytest.importorskip("datasets")

from hf_tiny import build_converted, offline_datasets  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from jaxdist import convert  # noqa: E402
from jaxdist.layout.mesh import parse_mesh  # noqa: E402
from jaxdist.training.dpo import REWARD_METRICS  # noqa: E402
from jaxdist.training.run import build_trainer, run  # noqa: E402
from jaxdist.training.weights import checkpoint_config, find_checkpoint  # noqa: E402

from helpers import first_batch  # noqa: E402

SEQ = 32
BETA = 0.5
LR = 0.1
PAIRS = [
    {"prompt": "Q: two and two\nA:", "chosen": " four", "rejected": " five"},
    {"prompt": "Q: sky colour\nA:", "chosen": " blue", "rejected": " green"},
    {"prompt": "Q: a cat says\nA:", "chosen": " meow", "rejected": " woof woof"},
    {"prompt": "The quick brown", "chosen": " fox jumps", "rejected": " dog"},
    {"prompt": "Opposite of up is", "chosen": " down", "rejected": " left, right"},
    {"prompt": "1, 2, 3,", "chosen": " 4, 5", "rejected": " 10"},
]


@pytest.fixture(scope="module", autouse=True)
def offline(tmp_path_factory):
    with offline_datasets(tmp_path_factory.mktemp("hf_datasets")):
        yield


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(root: hf/, jaxdist/ (converted), pairs.jsonl)."""
    root = tmp_path_factory.mktemp("dpo_trl")
    build_converted(root, SEQ)
    (root / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    return root


def jaxdist_config(root, loss: str):
    return checkpoint_config(
        find_checkpoint(str(root / "jaxdist")),
        [
            "train.objective=dpo", "data.source=preference", f"data.path={root / 'pairs.jsonl'}", f"train.dpo_loss={loss}",
            f"train.dpo_beta={BETA}", "train.optimizer=sgd", f"train.lr={LR}", "train.schedule=constant", "train.warmup_steps=0", "train.grad_clip=0",
            "train.weight_decay=0", "model.dtype=float32", f"train.seq_len={SEQ}", f"train.global_batch={2 * len(PAIRS)}",
            "train.steps=2", "checkpoint.every_steps=1", "checkpoint.keep=2", "train.eval_every=0", "data.shuffle=false",
        ],
    )  # fmt: skip


def trl_trainer(root, loss: str):
    """TRL's trainer on the same model and pairs: plain SGD at the same rate, no clipping, no
    decay, every pair in one batch, the reference a frozen copy of the initial weights."""
    hf = root / "hf"
    policy = transformers.LlamaForCausalLM.from_pretrained(hf, dtype=torch.float32)
    reference = transformers.LlamaForCausalLM.from_pretrained(hf, dtype=torch.float32)
    args = trl.DPOConfig(
        output_dir=str(root / f"trl-{loss}"), beta=BETA, loss_type=[loss], per_device_train_batch_size=len(PAIRS), report_to=[],
        learning_rate=LR, optim="sgd", lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0,
        use_cpu=True, bf16=False, fp16=False, max_length=SEQ,
    )  # fmt: skip
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    trainer = trl.DPOTrainer(
        model=policy, ref_model=reference, args=args, train_dataset=datasets.Dataset.from_list(PAIRS), processing_class=tokenizer
    )
    return trainer, policy


def trl_step(trainer, policy, batch) -> tuple[float, dict[str, float], dict[str, np.ndarray]]:
    """TRL's loss, reward metrics and gradients on ``batch`` (its metrics as it logs them)."""
    trainer._metrics["train"].clear()
    policy.train()
    policy.zero_grad()
    loss = trainer.compute_loss(policy, batch)
    loss.backward()
    metrics = {key: trainer._metrics["train"][key][-1] for key in REWARD_METRICS}
    grads = {name: p.grad.detach().numpy().copy() for name, p in policy.named_parameters()}
    return float(loss), metrics, grads


def safetensors_dir(directory) -> dict[str, np.ndarray]:
    """Every tensor of a Hugging Face model directory (one file or shards)."""
    return {name: x for path in sorted(directory.glob("*.safetensors")) for name, x in load_file(path).items()}


def rows_of(trl_batch) -> list[tuple[list[int], list[int]]]:
    """TRL's batch ([chosen..., rejected...], padded) as jaxdist's pairs of rows (chosen, rejected):
    each row's tokens and the mask of the tokens its loss predicts."""
    ids, mask, completion = (trl_batch[k].numpy() for k in ("input_ids", "attention_mask", "completion_mask"))
    n = len(ids) // 2
    rows = []
    for k in range(n):
        for r in (k, n + k):
            length = int(mask[r].sum())
            rows.append((ids[r][:length].tolist(), completion[r][1:length].tolist()))
    return rows


@pytest.mark.heavy
@pytest.mark.parametrize("loss", ["sigmoid", "ipo"])
def test_loss_metrics_and_gradients_equal_trls(setup, loss, tmp_path):
    root = setup
    config = jaxdist_config(root, loss)
    trainer, policy = trl_trainer(root, loss)
    trl_batch = next(iter(trainer.get_train_dataloader()))

    # the same rows: jaxdist's pairs (adjacent rows, answers masked) against TRL's collated batch
    layout = build_trainer(config, parse_mesh("data=1"), jax.devices()[:1]).layout
    ours = jax.device_get(first_batch(config, layout))
    got = []
    for row in range(len(ours["inputs"])):
        mask = np.asarray(ours["loss_mask"][row])
        length = int(np.nonzero(mask)[0][-1]) + 1
        tokens = [int(ours["inputs"][row][0]), *np.asarray(ours["targets"][row][:length]).tolist()]
        got.append((tokens, mask[:length].astype(int).tolist()))
    assert sorted(got) == sorted(rows_of(trl_batch))

    run(config, parse_mesh("data=1"), tmp_path / "run", devices=jax.devices()[:1], progress=False, init_from=str(root / "jaxdist"))
    records = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) if "loss" in r]

    # step 1: the policy is the reference
    trl_loss, trl_metrics, grads = trl_step(trainer, policy, trl_batch)
    assert trl_loss == pytest.approx(np.log(2.0) if loss == "sigmoid" else (1 / (2 * BETA)) ** 2, abs=1e-6)
    np.testing.assert_allclose(records[0]["loss"], trl_loss, atol=1e-5, rtol=1e-5)
    assert convert.main(["to-hf", str(tmp_path / "run" / "checkpoints" / "1"), str(tmp_path / "hf1"), "--dtype", "float32"]) == 0
    before, after = safetensors_dir(root / "hf"), safetensors_dir(tmp_path / "hf1")
    assert set(after) == set(grads), (sorted(after), sorted(grads))
    largest = max(float(np.abs(g).max()) for g in grads.values())
    assert largest > 1e-3  # the step moves the weights
    for name, grad in grads.items():
        np.testing.assert_allclose((before[name] - after[name]) / LR, grad, atol=1e-4, rtol=1e-3, err_msg=name)

    # step 2: the same SGD step taken in TRL's model, then both score the pairs again
    with torch.no_grad():
        for p in policy.parameters():
            p -= LR * p.grad
    trl_loss, trl_metrics, _ = trl_step(trainer, policy, trl_batch)
    assert abs(trl_metrics["rewards/margins"]) > 1e-3
    np.testing.assert_allclose(records[1]["loss"], trl_loss, atol=1e-5, rtol=1e-5)
    for key in REWARD_METRICS:
        np.testing.assert_allclose(records[1][key], trl_metrics[key], atol=1e-5, rtol=1e-5, err_msg=key)
