"""Duck-typed sessions for server tests: what ``run_async`` does is the test's script."""

from __future__ import annotations

from types import SimpleNamespace


class ScriptedSession:
    """Duck-typed session whose run_async does what the test says."""

    def __init__(self, behaviour):
        self.behaviour = behaviour
        self.closed = False
        self.max_batch_size = 4
        self.manifest = None

    def get_inputs(self):
        return [SimpleNamespace(name="x", type="tensor(float)", shape=["batch", 3])]

    def get_outputs(self):
        return [SimpleNamespace(name="y", type="tensor(float)", shape=["batch", 3])]

    async def run_async(self, names, feed):
        return await self.behaviour(feed)

    def stats(self):
        return SimpleNamespace(
            queued=0, padding_fraction=0.0, requests=0, batches=0, errors={}, rows_histogram={}, rows=0
        )

    def close(self, drain=True):
        self.closed = True


class ScriptedTokenSession(ScriptedSession):
    def get_inputs(self):
        return [
            SimpleNamespace(name=n, type="tensor(int64)", shape=["batch", "sequence"])
            for n in ("input_ids", "attention_mask")
        ]

    def get_outputs(self):
        return [SimpleNamespace(name="pooled", type="tensor(float)", shape=["batch", 4])]
