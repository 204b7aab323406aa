"""`python -m vllm_dflash.patches`: the register as a Markdown table."""

from vllm_dflash.patches import REGISTER


def main() -> None:
    print("| symbol | kind | process | why | how | upstream | remove when |")
    print("|---|---|---|---|---|---|---|")
    for e in REGISTER:
        symbol = e.symbol + (f" ({', '.join(e.names)})" if e.names else "")
        cells = (f"`{symbol}`", e.kind, ", ".join(e.process), e.why, e.how, e.upstream or "-", e.remove_when)
        print("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")


if __name__ == "__main__":
    main()
