"""``demo_negate``: multiplies every item's values by -1 (a stage from another package)."""

from dataclasses import dataclass

from pipeline.stage import Port
from stages.examples import ITEM


class Negate:
    @dataclass
    class Config:
        scale: float = 1.0

    inputs = {"items": Port(ITEM)}
    outputs = {"out": Port(ITEM)}

    def __init__(self, config, ctx):
        self.config, self.ctx = config, ctx

    async def setup(self):
        self.ctx.log.info("plugin_stage_ready", plugin="inflight-plugin-demo")

    async def run(self):
        out = self.ctx.outputs["out"]
        async for msg in self.ctx.inputs["items"]:
            values = msg.data["values"] * -self.config.scale
            await out.send("item", {"id": msg.data["id"], "values": values})

    async def close(self):
        pass
