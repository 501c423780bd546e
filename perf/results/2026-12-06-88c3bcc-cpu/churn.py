"""Gateway CPU per connection (perf/results/2026-12-06-88c3bcc-cpu/churn.py ROOT PORT, ROOT a checkout: main or this one): N connections that each send one small request (keep-alive: 20 requests each) or nothing."""
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

root, port = sys.argv[1], int(sys.argv[2])
env = dict(os.environ, PYTHONPATH=f"{root}/python_models:{root}/client")
proc = subprocess.Popen([sys.executable, "-m", "pergola.cli", "gateway", "--triton", "127.0.0.1:1", "--gateway-port", str(port),
                         "--gateway-bind", "127.0.0.1", "--models", "m"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
def cpu():
    t = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    return float(re.search(r"^process_cpu_seconds_total ([0-9.e+]+)$", t, re.M).group(1))
for _ in range(100):
    try: cpu(); break
    except OSError: time.sleep(0.3)
out = {}
for kind in ("connect_close", "request_close", "keepalive_20"):
    c0 = cpu(); n = 3000 if kind != "keepalive_20" else 600
    for i in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        if kind == "request_close":
            s.sendall(b"GET /nothing HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            while s.recv(65536): pass
        elif kind == "keepalive_20":
            for _ in range(20):
                s.sendall(b"GET /nothing HTTP/1.1\r\nHost: x\r\n\r\n")
                d = b""
                while not d.endswith(b"Not Found"): d += s.recv(65536)
        s.close()
    time.sleep(0.5)
    out[kind] = round((cpu() - c0) / (n if kind != "keepalive_20" else n * 20) * 1e6, 1)
proc.terminate(); proc.wait()
print(json.dumps({"root": root, "gateway_cpu_us_per": out}))
