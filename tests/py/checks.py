"""The runner the Python check scripts share: every `check_*` function of a
module (or those named) runs, each failure is printed with its check's name,
and the exit status is the number failed (2 for an unknown name)."""

import traceback


def run(module_globals, names):
    checks = {k: v for k, v in module_globals.items() if k.startswith("check_")}
    unknown = [n for n in names if "check_" + n not in checks and n not in checks]
    if unknown:
        print(f"no such check: {unknown}")
        return 2
    chosen = [
        (k, f) for k, f in checks.items() if not names or k in names or k[len("check_") :] in names
    ]
    failed = 0
    for name, f in chosen:
        try:
            f()
            print(f"ok   {name}", flush=True)
        except Exception:  # noqa: BLE001 -- every failure is reported by name
            failed += 1
            print(f"FAIL {name}", flush=True)
            traceback.print_exc()
    print(f"{len(chosen) - failed} passed, {failed} failed")
    return min(failed, 100)
