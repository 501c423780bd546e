"""tritonserver RSS after each flood through the gateway; env variant from argv."""
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from pergola.cli import default_model_folder
from pergola.server import free_port, wait_ready
from pergola.supervisor import resident_bytes

variant = dict(kv.split("=", 1) for kv in sys.argv[2:])
root = Path(tempfile.mkdtemp(prefix="rss-"))
http, grpc, metrics, gw = free_port(), free_port(), free_port(), free_port()
env = dict(os.environ, **variant)
cmd = [sys.executable, "-m", "pergola.cli", "serve", "--model", f"mini={default_model_folder()}", "--repo", str(root / "repo"),
       "--device", "cpu", "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
       "--gateway-port", str(gw), "--gateway-bind", "127.0.0.1"]
proc = subprocess.Popen(cmd, stdout=open(root / "log", "wb"), stderr=subprocess.STDOUT, env=env)
wait_ready(http, proc, timeout=600)
time.sleep(3)
def triton_pid():
    for c in Path("/proc").glob("[0-9]*/cmdline"):
        try: a = c.read_bytes().split(b"\0")
        except OSError: continue
        if a[0].endswith(b"tritonserver") and f"--model-repository={root/'repo'}".encode() in a: return int(c.parent.name)
pid = triton_pid()
texts = [f"text number {i} " + " ".join(["pergola garden word"] * int(os.environ.get("WORDS", "2"))) for i in range(int(os.environ.get("NTEXTS", "32")))]
def one():
    body = json.dumps({"model": "mini", "input": texts}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{gw}/v1/embeddings", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r: r.read(); return r.status
    except urllib.error.HTTPError as e: return e.code
    except OSError: return 0
# warm
for _ in range(5): one()
series = [resident_bytes(pid) >> 20]
for flood in range(int(os.environ.get("FLOODS", "5"))):
    stop = time.monotonic() + 12
    codes = []
    def client():
        while time.monotonic() < stop: codes.append(one())
    th = [threading.Thread(target=client) for _ in range(int(os.environ.get("CLIENTS", "48")))]
    [t.start() for t in th]; [t.join() for t in th]
    time.sleep(5)
    series.append(resident_bytes(pid) >> 20)
    print(variant, "flood", flood, "codes", {c: codes.count(c) for c in set(codes)}, "rss MB", series, flush=True)
proc.send_signal(signal.SIGTERM); proc.wait(timeout=120)
