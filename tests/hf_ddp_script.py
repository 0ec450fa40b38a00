"""Run by tests/test_hf.py under torchrun (2 CPU processes, gloo): AGG + a loss-term plugin +
metrics in a real DDP Trainer run; each rank writes what it saw to <out>/rank<r>.json."""

import json
import os
import sys

from transformers import Trainer, TrainingArguments

from aniso_plugins import AnisoConfig
from aniso_plugins.integrations.hf import AnisoCallback
from hf_utils import GradCapture, TokenDataset, tiny_gpt2
from third_party_plugin import HeadNormPlugin

out = sys.argv[1]
rank = int(os.environ["RANK"])


def run(coef):
    cap = GradCapture(("transformer.wte.weight",))
    cfg = AnisoConfig(method="agg", alpha=0.5, window=4, metrics=("geometry",), load_entry_points=False)
    cb = AnisoCallback(cfg, plugins=[HeadNormPlugin(coef)])
    args = TrainingArguments(
        output_dir=os.path.join(out, "run"), use_cpu=True, ddp_backend="gloo", per_device_train_batch_size=2,
        gradient_accumulation_steps=2, max_steps=3, logging_steps=1, max_grad_norm=0.0, report_to="none",
        save_strategy="no", disable_tqdm=True, seed=0,
    )
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenDataset(), callbacks=[cb, cap])
    assert trainer.args.parallel_mode.value == "distributed" and trainer.args.world_size == 2
    w0 = trainer.model.transformer.wte.weight.detach().clone()
    trainer.train()
    return cb, cap, w0, trainer


cb0, cap0, w0, _ = run(0.0)
cb1, cap1, w1, trainer = run(0.5)
state = cb1.session.plugins.state_dict()
record = {
    "gates": {f"{ns}/{k}": v.double().flatten().tolist() for ns, d in state.items() for k, v in d.items()},
    "rare": {k: v for r in trainer.state.log_history for k, v in r.items() if k.startswith("aniso/agg")},
    "metrics": [{k: v for k, v in r.items() if k.startswith("aniso/")} for r in trainer.state.log_history],
    "term_grad": (cap1.grads[0]["transformer.wte.weight"] - cap0.grads[0]["transformer.wte.weight"]).tolist(),
    "expected_term_grad": (2 * 0.5 * w1).tolist(),
}
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(record, f)
