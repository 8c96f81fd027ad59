"""A user's plain script, run as ``python script.py`` the way a user runs it: its own model, no
``if __name__ == "__main__":`` guard, compiling and training in one process.

This is where the start method bites: the compiler's backward passes (profiling, and on some
builds ``torch.export``) can leave autograd unable to run in a forked child, the runtime-overheads
probe and the trainer then start workers without forking, and a spawned child must not run the
script's top level again. The script trains two steps and checks itself against eager training.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent('''
    import copy, json, torch, torch.nn as nn
    import harmony
    from harmony.runtime.reference import microbatches_of, reference_train

    V, T, W = 64, 16, 32

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(W), nn.LayerNorm(W)
            self.attn = nn.MultiheadAttention(W, 4, batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(W, 4 * W), nn.GELU(), nn.Linear(4 * W, W))

        def forward(self, x):
            h = self.ln1(x)
            x = x + self.attn(h, h, h, need_weights=False)[0]
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.tok, self.pos = nn.Embedding(V, W), nn.Parameter(torch.zeros(1, T, W))
            self.blocks = nn.ModuleList(Block() for _ in range(n))
            self.ln, self.head = nn.LayerNorm(W), nn.Linear(W, V)

        def forward(self, idx):
            x = self.tok(idx) + self.pos[:, :idx.shape[1]]
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln(x))

    def loss_fn(out, target):
        return nn.functional.cross_entropy(out.reshape(-1, V), target.reshape(-1))

    def get_batch(b, step):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, V, (b, T), generator=g)
        return x, torch.roll(x, -1, 1)

    torch.manual_seed(0)
    model = GPT(3).double()
    reference = copy.deepcopy(model)
    out = model(get_batch(2, 0)[0])  # the user's own backward before compiling, as a notebook would
    loss_fn(out, get_batch(2, 0)[1]).backward()
    model.zero_grad(set_to_none=True)
    plan = harmony.compile(model, loss_fn, get_batch, minibatch_size=8, devices=2, device_memory=MEMORY,
                           mode="pp", device_type="cpu")
    batches = [get_batch(8, step) for step in range(2)]
    trainer = harmony.Trainer(plan, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01))
    losses = [trainer.step(*batch) for batch in batches]
    trainer.close()
    expected = reference_train(reference, loss_fn, lambda ps: torch.optim.SGD(ps, lr=0.01), batches,
                               microbatches_of(plan.tasks))
    print("RESULT", json.dumps({"losses": losses, "expected": expected}))
''')


def run_script(tmp_path, memory: int) -> dict:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT.replace("MEMORY", str(memory)))
    done = subprocess.run([sys.executable, str(path)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


@pytest.mark.slow
def test_a_plain_script_without_a_main_guard_compiles_and_trains_as_eager_does(tmp_path):
    result = run_script(tmp_path, memory=8 << 20)
    assert result["losses"] == pytest.approx(result["expected"], rel=1e-9)
