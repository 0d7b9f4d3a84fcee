"""A few megatron training steps checked against the plain trainer, in a process of its own
(a world of one; the default device it sets stays there): ``tests.megatron_fixtures.run_steps``
runs it for the CUDA test and its CPU rehearsal
(``python -m tests.scripts.megatron_steps <model folder> <work dir> cuda|cpu``); prints
``RESULT {json}``, which ``check_steps`` reads."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch


def main(argv: list[str]) -> None:
    warnings.filterwarnings("ignore")
    torch.use_deterministic_algorithms(True)
    src, work, cuda = Path(argv[0]), Path(argv[1]), argv[2] == "cuda"
    if cuda:
        from gpu_runtime.trainer.common.device import use_device

        use_device("cuda:0")  # as the trainer process of a --device cuda node
    else:
        from tests.megatron_fixtures import shim_cpu_forward

        shim_cpu_forward()
    from transformers import AutoModelForCausalLM

    from gpu_runtime.models.causal_lm import export_state_dict
    from gpu_runtime.store.artifacts import Sample
    from gpu_runtime.trainer.megatron.trainer import MegatronTrainer
    from gpu_runtime.trainer.policy.trainer import PolicyTrainer
    from spec.train import TrainSpec

    hp = TrainSpec(lr=1e-4, warmup_steps=2, micro_batch_size=4)

    def batch(step: int) -> tuple[list[Sample], list[float]]:
        lens = {(p, g): 1 + (g + p + step) % 4 for p in range(2) for g in range(4)}
        samples = [Sample(sample_id=f"s{step}-p{p}-g{g}", prompt_index=p, group_index=g, prompt_ids=[1, 5 + p, 6 + step],
                          response_ids=[7, 8, 9 + g, 10][: lens[p, g]], logprobs=[-1.0] * lens[p, g],
                          weight_version=step - 1, finish_reason="length") for p in range(2) for g in range(4)]
        return samples, [float((g + p * step) % 3) / 2 for p in range(2) for g in range(4)]

    out: dict[str, object] = {}
    want = PolicyTrainer.create(src, hp, 0).train_step(*batch(1), 4, hp)
    a = MegatronTrainer.create(src, hp, 0, require_cuda=cuda)
    steps = [a.train_step(*batch(1), 4, hp)]
    a.save_state(work / "ck")
    steps += [a.train_step(*batch(k), 4, hp) for k in (2, 3)]
    out["want"] = {k: want[k] for k in ("loss", "grad_norm", "entropy", "clip_fraction")}
    out["got"] = {k: steps[0][k] for k in ("loss", "grad_norm", "entropy", "clip_fraction")}
    out["same_metric_names"] = set(want) == set(steps[0])
    out["lrs"] = [m["lr"] for m in steps]
    out["versions"] = [m["policy_version"] for m in steps]
    out["a"] = a.checksum()
    b = MegatronTrainer.create(src, hp, 0, require_cuda=cuda)
    for k in (1, 2, 3):
        b.train_step(*batch(k), 4, hp)
    out["b"] = b.checksum()
    del b
    c = MegatronTrainer.from_state(work / "ck", require_cuda=cuda)
    for k in (2, 3):
        c.train_step(*batch(k), 4, hp)
    out["c"] = c.checksum()
    del c
    ck = a.export_model_folder(work / "v3")
    hf = export_state_dict(AutoModelForCausalLM.from_pretrained(str(work / "v3"), dtype=torch.float32))
    mine = a.published_state()
    out["export"] = [ck == out["a"], set(hf) == set(mine) and all(torch.equal(hf[k].cpu(), mine[k].cpu()) for k in mine)]
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
