"""The two-turn harness (../../fair-2026-11-27/turns.py) against the default pair started as
`card-client up` starts it (LocalTrio, metrics on), then the draft worker's prefix-cache hits over
its queries. Usage: turns_probe.py LABEL [OUT] (OUT: where turns-LABEL.json goes, default /tmp)."""
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from card.client.trio import LocalTrio

TURNS = Path(__file__).resolve().parents[2] / "fair-2026-11-27" / "turns.py"
label = sys.argv[1]
out = sys.argv[2] if len(sys.argv) > 2 else "/tmp"


def metric(port: int, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))


with LocalTrio(target_model="default", draft_model="default", draft_quantize="int8", http_port=8013,
               http_host="127.0.0.1", metrics=True, log_dir=Path(tempfile.mkdtemp(prefix="turns-"))) as trio:
    subprocess.run(["nice", "-n", "19", sys.executable, str(TURNS), "http://127.0.0.1:8013", "default", label,
                    out], start_new_session=True)
    port = trio.metrics_ports["card-draft-0"]
    queries = metric(port, "card_draft_prefix_cache_queries_total")
    hits = metric(port, "card_draft_prefix_cache_hits_total")
    print(f"{label}: draft prefix cache {hits:.0f} of {queries:.0f} prompt tokens ({hits / queries:.0%})",
          flush=True)
