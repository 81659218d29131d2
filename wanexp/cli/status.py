"""Print a run's status.json as a table, or one row per point of a sweep folder; ``--follow`` refreshes it.

    python -m wanexp.cli.status outputs/demo                  # one run (per-rank rows included)
    python -m wanexp.cli.status outputs/sweeps/rank_lr        # a sweep: one row per point
    python -m wanexp.cli.status outputs/demo --follow         # redraw every 2 s until the run(s) end (Ctrl-C stops)
    python -m wanexp.cli.status outputs --serve               # the live page of every run: http://127.0.0.1:8765/

``--serve`` (wanexp.cli.status_server) serves a page and a JSON API over a run, sweep or outputs folder, read-only,
on 127.0.0.1 unless ``--host`` (with ``--token``) says otherwise.

Installed as ``wanexp-status``. Reads only the files a run writes (status.json is replaced atomically by rank 0 every
few seconds), so it works on a live run, a finished one, or a copy of the folder. A run whose status says
``running`` but whose process is gone (same host) is shown as ``dead``; one not updated for 10 minutes as ``stale``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from wanexp.cli.run_status import live_state, read_status, run_seconds
from wanexp.errors import UserError, say_error

def _hms(seconds) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}"


def _num(v, spec: str = ".4g") -> str:
    return "-" if v is None else format(v, spec) if isinstance(v, (int, float)) else str(v)


def elapsed(s: dict) -> str:
    """The run's training time, and this session's when it resumed from a checkpoint."""
    if not s.get("start_step"):
        return _hms(run_seconds(s))
    return f"{_hms(run_seconds(s))} ({_hms(s.get('elapsed_s'))} since the resume at step {s['start_step']})"


def learning_rate(s: dict) -> str:
    """The lr the last step used, and the schedule's base (``optim.lr`` after ``lr_scaling``) when it differs."""
    lr, base = s.get("lr"), (s.get("optimizer") or {}).get("base_lr")
    shown = f"lr {_num(lr, '.3g')} (last step"
    return shown + (f"; base {_num(base, '.3g')})" if base is not None and base != lr else ")")


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def run_view(run: Path, s: dict) -> str:
    total = s.get("total_steps")
    step = s.get("step")
    pct = f" ({100 * step / total:.1f} %)" if step is not None and total else ""
    ckpt = s.get("last_checkpoint") or s.get("checkpoint")
    fields = [
        ("run", f"{s.get('run_name', run.name)}  ({run})"),
        ("state", live_state(s) + (f" ({s['signal']})" if s.get("signal") else "") +
         (f": {s['error']}" if s.get("error") else "")),
        ("step", f"{_num(step)} / {_num(total)}{pct}   epoch {_num(s.get('epoch'))}"),
        ("eta", f"{_hms(s.get('eta_s'))}   elapsed {elapsed(s)}   step {_num(s.get('step_time_s'), '.3g')} s"),
        ("train loss", f"{_num(s.get('loss'))} (last logged step)" +
                       (f"   val/loss {_num(s['val_loss'])}" if s.get("val_loss") is not None else "") +
                       f"   {learning_rate(s)}"),
        ("throughput", f"{_num(s.get('samples_per_s'), '.3g')} samples/s   {_num(s.get('tokens_per_s'), '.4g')} tokens/s"
                       f"   {_num(s.get('tflops'), '.3g')} TFLOP/s per device" +
                       (f" ({s['pct_of_peak']:.1f} % of peak)" if s.get("pct_of_peak") is not None else "")),
        ("memory", "- (no GPU)" if s.get("mem_gib") is None else
                   f"{s['mem_gib']:.1f} GiB   peak {_num(s.get('peak_mem_gib'), '.1f')} GiB" +
                   (f"   GPU {s['gpu_util']:.0f} %" if s.get("gpu_util") is not None else "") + card(s)),
        ("checkpoint", str(ckpt or "-")),
        ("rejects", f"{_num((s.get('data') or {}).get('rejected'))} before training, "
                    f"{_num(s.get('rejected_online'))} during   skipped steps {_num(s.get('skipped_steps'))}"),
        ("process", f"{s.get('host', '-')} pid {s.get('pid', '-')}, {s.get('world_size', '-')} rank(s); "
                    f"updated {_hms(time.time() - s['updated']) if s.get('updated') else '-'} ago"),
    ]
    if s.get("lora_flagged"):
        fields.append(("flagged", f"{len(s['lora_flagged'])} LoRA export(s) with runaway weights (lora_flagged)"))
    out = "\n".join(f"{k:<11} {v}" for k, v in fields)
    ranks = s.get("ranks") or []
    if len(ranks) > 1 or any(r.get("mem_gib") is not None for r in ranks):
        rows = [[r.get("rank"), _num(r.get("step")), _num(r.get("loss")), _num(r.get("samples_per_s"), ".3g"),
                 _num(r.get("mem_gib"), ".1f"), _num(r.get("peak_mem_gib"), ".1f"), _num(r.get("gpu_util"), ".0f"),
                 _num(r.get("gpu_power_w"), ".0f"), _num(r.get("gpu_clock_mhz"), ".0f"),
                 _num(r.get("rejected_online"))] for r in ranks]
        out += "\n\nper rank (at the last logged step)\n" + table(
            rows, ["rank", "step", "train loss", "samples/s", "mem GiB", "peak GiB", "GPU %", "W", "SM MHz", "rejects"])
    return out


def card(s: dict) -> str:
    """The GPU's power (of its limit) and SM clock, where NVML reported them: a card at its power limit runs at a
    lower clock."""
    out = ""
    if s.get("gpu_power_w") is not None:
        limit = s.get("gpu_power_limit_w")
        out += f"   {s['gpu_power_w']:.0f} W" + (f" of {limit:.0f}" if limit else "")
    if s.get("gpu_clock_mhz") is not None:
        out += f"   SM {s['gpu_clock_mhz']:.0f} MHz"
    return out


def sweep_view(folder: Path) -> tuple[str, bool]:
    """One row per point of a sweep folder: every point of its grid, run or not, with its state
    (wanexp.callbacks.sweep.sweep_rows), and below the table why each point that did not finish stopped; and
    whether a point shown is still running. An empty string when the folder holds no sweep."""
    from wanexp.callbacks.sweep import sweep_rows

    rows, reasons, running = [], [], False
    for point in sweep_rows(folder):
        run = Path(point["run_dir"])
        if point["state"] in ("refused", "not started") or not (run / "status.json").exists():
            rows.append([point["point"], "-", point["state"], *["-"] * 6])  # nothing of it ran (its folder: not its)
        else:
            s = read_status(run)
            name = str(s.get("run_name", run.name)).rpartition("/")[2]
            rows.append([run.name, name, live_state(s), f"{_num(s.get('step'))}/{_num(s.get('total_steps'))}",
                         _num(s.get("loss")), _num(s.get("val_loss")), _num(s.get("samples_per_s"), ".3g"),
                         _hms(s.get("eta_s")), _hms(run_seconds(s))])
            running = running or rows[-1][2] == "running"
        if point["reason"]:
            reasons.append(f"point {point['point']} {point['state']}: {point['reason']}")
    if not rows:
        return "", False
    states = [r[2] for r in rows]
    head = f"sweep {folder}: {len(rows)} points (" + ", ".join(f"{states.count(x)} {x}" for x in sorted(set(states))) + ")"
    # status.json's loss is one step's train loss; the sweep summary's is a mean over several steps: named apart
    text = head + "\n" + table(rows, ["point", "run", "state", "step", "train loss (last step)", "val/loss",
                                      "samples/s", "eta", "elapsed"])
    return text + "".join(f"\n{line}" for line in reasons), running


def render(folder: Path) -> tuple[str, bool]:
    """(the text, whether anything shown is still running)."""
    if (folder / "status.json").exists():
        s = read_status(folder)
        return run_view(folder, s), live_state(s) == "running"
    text, running = sweep_view(folder)
    if not text:
        raise UserError(f"{folder}: no status.json here or in its subfolders; give a run folder (outputs/<run_name>, "
                        "written once training starts) or a sweep folder (outputs/sweeps/<name>)")
    return text, running


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="wanexp-status", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:6]))
    ap.add_argument("folder", help="a run folder (holds status.json) or a sweep folder (one run folder per point)")
    ap.add_argument("--follow", "-f", action="store_true", help="redraw until every run shown has ended")
    ap.add_argument("--every", type=float, default=2.0,
                    help="seconds between redraws with --follow, between the page's updates with --serve (default 2)")
    ap.add_argument("--serve", action="store_true",
                    help="serve a live page of the run(s) and their JSON API (FOLDER may also be an outputs folder)")
    ap.add_argument("--host", default=None, help="with --serve: the address to listen on (default 127.0.0.1; any "
                                                 "other needs --token)")
    ap.add_argument("--port", type=int, default=None, help="with --serve: the port (default 8765; 0: any free one)")
    ap.add_argument("--token", default=os.environ.get("WANEXP_STATUS_TOKEN"),
                    help="with --serve: a secret every request must carry (?token= or the header X-Wanexp-Token); "
                         "default: $WANEXP_STATUS_TOKEN")
    args = ap.parse_args(argv)
    folder = Path(args.folder)
    try:
        if args.serve:
            if args.follow:
                raise UserError("--follow redraws the table in the terminal, --serve serves the page: give one")
            from wanexp.cli.status_server import serve

            return serve(folder, args.host or "127.0.0.1", 8765 if args.port is None else args.port, args.token,
                         max(0.2, args.every))
        if args.host is not None or args.port is not None:
            raise UserError("--host and --port go with --serve (the live page)")
        if not folder.is_dir():
            raise UserError(f"{folder}: no such folder; give a run folder (outputs/<run_name>) or a sweep folder "
                            "(outputs/sweeps/<name>)")
        while True:
            text, running = render(folder)
            if args.follow and sys.stdout.isatty():
                print("\033[H\033[2J", end="")
            print(text, flush=True)
            if not (args.follow and running):
                return 0
            time.sleep(max(0.2, args.every))
            if not sys.stdout.isatty():
                print()
    except UserError as e:
        say_error(str(e))
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (``| head -1``): stop quietly, as Unix tools do
        silence_stdout()
        return 141  # 128 + SIGPIPE, what a shell reports for a tool the closed pipe stopped


def silence_stdout() -> None:
    """Point stdout at /dev/null: what is still buffered for a closed pipe is not flushed to it again at exit (that
    flush would print a BrokenPipeError of its own)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # a stdout without a file descriptor (io.UnsupportedOperation is both)
        pass


if __name__ == "__main__":
    sys.exit(main())
