"""`minisgl-lm-eval`: the stock lm-eval CLI with `minisgl` registered, whatever the install state of the
.pth hook (e.g. `pip install --no-compile` into a read-only site, or a future lm-eval)."""

from __future__ import annotations


def main() -> None:
    from lm_eval_minisgl import missing_extra, register

    try:
        register()
        from lm_eval.__main__ import cli_evaluate
    except ModuleNotFoundError as e:  # the lm-eval extra is not installed
        raise SystemExit(str(missing_extra(e))) from None

    cli_evaluate()


if __name__ == "__main__":
    main()
