"""lm-evaluation-harness tasks during training: ``train.harness_tasks`` every
``train.harness_every`` steps (0: at the last step only), and at the last step.

The live weights are scored where they are, on the run's mesh and in its parameter
shardings (``inference.harness.Scorer``): nothing is saved or reloaded, and the scoring
programs compile once and serve every evaluation. Every process runs the same requests in
the same order (the programs are SPMD); process 0 writes ``RUN_DIR/eval/STEP.json``, the
file ``jaxdist eval --tasks`` writes for a checkpoint. The loop logs each metric as
``TASK/METRIC`` (metrics.jsonl, TensorBoard, W&B) and its time as goodput's ``eval``.

Tasks are checked before the first step (lm-eval installed, every task known, nothing to
download; with ``train.harness_chat_template`` the template found): a run that would fail at
its first evaluation is refused in one line instead.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from jaxdist.config import Config
from jaxdist.data.chat_template import find_chat_template
from jaxdist.data.tokenizers import load_tokenizer
from jaxdist.inference import harness


class HarnessDuringTraining:
    def __init__(self, config: Config, run_dir: Path | None, is_main: bool):
        t = config.train
        self.tasks = [name.strip() for name in t.harness_tasks.split(",") if name.strip()]
        self.every = t.harness_every
        self.limit = t.harness_limit or None
        self.num_fewshot = None if t.harness_num_fewshot < 0 else t.harness_num_fewshot
        self.batch_size, self.max_length = t.harness_batch_size, t.seq_len
        self.run_dir, self.is_main = run_dir, is_main
        self.manager = harness.task_manager(self.tasks, t.harness_include_path or None)
        tokenizer = load_tokenizer(config.data.tokenizer or None)
        self.chat = t.harness_chat_template
        template = find_chat_template(config.data.chat_template, config.data.tokenizer) if self.chat else None
        self.text = harness.HarnessText(tokenizer, template, name=tokenizer.name)
        self._scorer: harness.Scorer | None = None

    @classmethod
    def from_config(cls, config: Config, run_dir: Path | None, is_main: bool) -> HarnessDuringTraining | None:
        """The evaluator ``config`` asks for; None when ``train.harness_tasks`` is empty."""
        return cls(config, run_dir, is_main) if config.train.harness_tasks.strip() else None

    def due(self, step: int, last: bool) -> bool:
        return last or (self.every > 0 and step % self.every == 0)

    def __call__(self, trainer: Any, step: int, params: Any) -> dict[str, float]:
        """Every task on ``params`` (in ``trainer``'s shardings): {"TASK/METRIC": value}."""
        if self._scorer is None or self._scorer.trainer is not trainer:  # a recovery's new mesh: new programs
            self._scorer = harness.Scorer(trainer, params, self.max_length, self.batch_size)
        self._scorer.params = params
        start = time.perf_counter()
        results = harness.run_tasks(
            harness.adapter(self._scorer, self.text),
            self.tasks,
            num_fewshot=self.num_fewshot,
            limit=self.limit,
            apply_chat_template=self.chat,
            manager=self.manager,
        )
        if self.is_main and self.run_dir is not None:
            record = {"tasks": results, "step": step, "seconds": round(time.perf_counter() - start, 3), "during_training": True}
            harness.write_step_results(self.run_dir, step, record)
        return {f"{task}/{metric}": value for task, metrics in results.items() for metric, value in metrics.items()}
