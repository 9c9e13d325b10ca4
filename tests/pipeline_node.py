"""One node of a two-stage pipeline under torchrun (tests/test_multinode.py): rank 0 decodes
greedily through the pipeline and writes the tokens; rank 1 serves its stage. With --until-killed,
rank 0 goes on stepping after `ready` until a step fails, and writes the error and its time."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from test_pipeline_run import NEW, PROMPT, Stage0, _plans, _spec  # noqa: E402


def main() -> int:
    from pagedllm.distributed.pipeline import PipelineExecutor
    from pagedllm.distributed.stage import pipeline_worker_main
    from pagedllm.loading.loader import read_config

    path, out, prompt = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    until_killed = "--until-killed" in sys.argv
    spec = _spec(path)
    rank = int(os.environ["RANK"])
    if rank > 0:
        pipeline_worker_main(rank, int(os.environ["WORLD_SIZE"]), None, spec)
    plan, num_blocks = _plans(read_config(spec.source), prompt)
    ex = PipelineExecutor.start(2, spec, timeout_s=15)
    result: dict = {}
    try:
        driver = Stage0(ex, spec, num_blocks)
        tokens, ids, start = [], prompt, 0
        for step in range(NEW):
            logits = driver.forward(plan(ids, start, decode=step > 0))
            start += len(ids)
            ids = [int(logits[0].argmax())]
            tokens.append(ids[0])
        result["tokens"] = tokens
        if until_killed:
            out.with_suffix(".ready").write_text(json.dumps(tokens))
            try:
                while True:
                    driver.forward(plan([7], PROMPT, decode=True))
            except Exception as e:
                result.update(error=f"{type(e).__name__}: {e}", failed_at=time.time())
    finally:
        out.write_text(json.dumps(result))
        ex.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
