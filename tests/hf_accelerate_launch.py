"""Run by ``accelerate launch`` in tests/test_hf_trainer_exact.py: one SFTTrainer run (``hf_runs``)
with ``prepare(trainer, sp_size=argv[1])``; rank 0 prints ``RESULT <json>`` with the logs, the
accelerate distributed type and the warnings ``prepare`` logged."""

from __future__ import annotations

import json
import logging
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hf_runs import train_and_eval  # noqa: E402


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # as accelerate would; train_and_eval runs in an existing group
    collect = _Collect()
    logging.getLogger("ulysses_sp.integrations").addHandler(collect)
    kind = os.environ.get("ACCELERATE_USE_FSDP", "false")
    out = train_and_eval(int(sys.argv[1]), kind="chat", accum=int(sys.argv[2]), steps=2)
    if dist.get_rank() == 0:
        keys = ("logs", "eval_loss", "name", "fsdp2")
        print(
            "RESULT",
            json.dumps({**{k: out[k] for k in keys}, "use_fsdp": kind, "warnings": collect.messages}),
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
