"""Run the shared DTensor overhead benchmark for torch and for meshtrain back to back; print ratios.

    python bench/dtensor_overhead.py [--only micro,redist] [--repeat 3] [--shared ../shared]

Both runs use `shared/bench/dtensor_overhead.py` unchanged, so the numbers are directly comparable;
the table shows median µs per call for each implementation and meshtrain / torch.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(impl: str, script: Path, extra: list[str]) -> dict:
    cmd = [sys.executable, str(script), "--impl", impl, *extra]
    if impl == "project":
        cmd += ["--project-root", str(ROOT)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if not lines:
        sys.exit(f"{impl} run printed no result:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shared", default=str(ROOT.parent / "shared"), help="path of the shared/ folder")
    ap.add_argument("--only", default="micro,redist,tp_mlp,fsdp")
    ap.add_argument("--repeat", default="1")
    ap.add_argument("--iters-scale", default="1.0")
    args = ap.parse_args()
    script = Path(args.shared) / "bench" / "dtensor_overhead.py"
    extra = ["--only", args.only, "--repeat", args.repeat, "--iters-scale", args.iters_scale]
    torch_res, ours = run("torch", script, extra), run("project", script, extra)
    t_med, o_med = torch_res.get("median_us", {}), ours.get("median_us", {})
    print(f"{'case':52s} {'torch_us':>10s} {'ours_us':>10s} {'ours/torch':>10s}")
    for case in t_med:
        t, o = t_med[case], o_med.get(case, float("nan"))
        ratio = o / t if t and not math.isnan(t) and not math.isnan(o) else float("nan")
        print(f"{case:52s} {t:10.1f} {o:10.1f} {ratio:10.2f}")
    for impl, res in (("torch", torch_res), ("ours", ours)):
        for case, err in res.get("errors", {}).items():
            print(f"ERROR {impl} {case}: {err}")
        if res.get("missing_names"):
            print(f"{impl} missing names: {res['missing_names']}")
    print("comm counts torch:", json.dumps(torch_res.get("comm_counts", {})))
    print("comm counts ours: ", json.dumps(ours.get("comm_counts", {})))
    print("loadavg torch/ours:", torch_res.get("loadavg_1m_start_end"), ours.get("loadavg_1m_start_end"))


if __name__ == "__main__":
    main()
