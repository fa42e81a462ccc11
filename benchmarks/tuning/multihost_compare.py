"""Side by side: the tune sweeps recorded by multihost_record.sh (1 host, 2
namespace hosts, 2 namespace hosts at 1 Gbit/s): each backend's time per op and
size, the backend each setting's tuning table picks, and how many (op, size)
cells change backend between settings. Reads out/record/multihost/multihost-*.json (multihost_record.sh)."""
import json
from pathlib import Path

RES = Path(__file__).resolve().parents[2] / "out" / "record" / "multihost"  # the recorded sweeps
SETTINGS = ("1host", "2hosts", "2hosts-1gbit")


def human(n):
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def pick(table, op, nbytes):
    rules = next(iter(table["rules"][op].values()))
    for r in rules:
        if r["max_bytes"] is None or nbytes <= r["max_bytes"]:
            return r["backend"]


times, tables, hosts = {}, {}, {}
for s in SETTINGS:
    doc = json.loads((RES / f"multihost-tune-{s}.json").read_text())
    hosts[s] = doc["metadata"]["hosts"]
    for r in doc["results"]:
        times.setdefault(r["op"], {}).setdefault(r["bytes"], {})[(s, r["variant"])] = r["max_us"]
    tables[s] = json.loads((RES / f"multihost-tuning-{s}.json").read_text())

print("ranks' hostnames per setting: " + "; ".join(f"{s}: {', '.join(h)}" for s, h in hosts.items()))
print("time in us (slowest rank, median of 9 rounds); pick = the setting's tuning table's backend\n")
head = f"{'op':15s} {'bytes':>6s}" + "".join(f" | {s:>12s} mpi {'gloo':>8s} {'pick':>4s}" for s in SETTINGS)
print(head)
print("-" * len(head))
changed = {s: 0 for s in SETTINGS[1:]}
cells = 0
for op, by_size in times.items():
    for nbytes, t in sorted(by_size.items()):
        cells += 1
        row = f"{op:15s} {human(nbytes):>6s}"
        picks = {}
        for s in SETTINGS:
            picks[s] = pick(tables[s], op, nbytes)
            row += f" | {t[(s, 'mpi')]:16.1f} {t[(s, 'gloo')]:8.1f} {picks[s]:>4s}"
        for s in SETTINGS[1:]:
            changed[s] += picks[s] != picks["1host"]
        print(row)
print()
for s, n in changed.items():
    print(f"{s}: {n} of {cells} (op, size) cells pick another backend than on 1 host")
for s in SETTINGS:
    print(f"\n{s} crossovers:")
    for op, by_g in tables[s]["rules"].items():
        rules = next(iter(by_g.values()))
        parts, prev = [], None
        for r in rules:
            span = (f"<= {human(r['max_bytes'])}" if r["max_bytes"] is not None
                    else (f"> {human(prev)}" if prev is not None else "all sizes"))
            parts.append(f"{r['backend']} {span}")
            prev = r["max_bytes"]
        print(f"  {op:15s} " + ", ".join(parts))
