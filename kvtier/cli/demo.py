"""``kvtier demo`` (the agent run): start, run both modes, report (``kvtier.local.demo``)."""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path

from rich.console import Console
from rich.markup import escape


def run_agent_demo(console: Console, *, quick: bool, out_dir: Path, state_dir: Path | None,
                   model: Path | None, as_json: bool) -> None:
    from kvtier.local.demo import DemoOptions, run_demo
    from kvtier.local.demo_report import report, text_report, write_outputs

    options = DemoOptions.quick() if quick else DemoOptions()
    with tempfile.TemporaryDirectory(prefix="kvtier-demo-") as tmp:
        root = (state_dir or Path(tmp)).expanduser().resolve()
        console.print(f"starting Valkey, Ray, a controller, a worker and the gateway in {escape(str(root))} ...")
        results = asyncio.run(run_demo(options, root, model, log=lambda line: console.print(escape(line))))
    out = report(results, options)
    paths = write_outputs(out, results, out_dir)
    if as_json:
        print(json.dumps(out, indent=2))
        return
    console.print(escape(text_report(out, results[0].transcript)), highlight=False)
    console.print(escape((out_dir / "demo.txt").read_text()), highlight=False)
    console.print("written: " + ", ".join(escape(str(p)) for p in paths))
