"""The argparse parser every `tllm` command line uses: no prefix matching (`--max-num-token`
is a typo, not `--max-num-tokens`), TensorRT-LLM's underscore spellings (`--max_batch_size`)
taken for our dashed flags, and an unknown flag answered with "did you mean --x?" (exit 2)."""
from __future__ import annotations

import argparse
import difflib
import sys

_HINTS = "_flag_hints"   # namespace attribute: {unknown flag: closest known one}
EPILOG = "Every --flag-name is also taken as --flag_name (TensorRT-LLM's spelling)."


class FlagParser(argparse.ArgumentParser):
    """An ArgumentParser whose subparsers are FlagParsers too (argparse builds them with the
    parent's class)."""

    def __init__(self, *args, allow_abbrev: bool = False, epilog: str | None = EPILOG,
                 **kwargs) -> None:
        super().__init__(*args, allow_abbrev=allow_abbrev, epilog=epilog, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        namespace, extras = super().parse_known_args(self._respelled(args), namespace)
        # Only the parser that knows a subcommand's flags can suggest one; its parent sees
        # the leftovers alone, so the hints travel on the namespace.
        hints = getattr(namespace, _HINTS, {})
        for arg in extras:
            name = arg.partition("=")[0]
            if name.startswith("-") and name not in hints:
                match = self.closest_flag(name)
                if match:
                    hints[name] = match
        if hints:
            setattr(namespace, _HINTS, hints)
        return namespace, extras

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        hints = vars(namespace).pop(_HINTS, {})
        if extras:
            self.error(unrecognized_message(extras, hints))
        return namespace

    def closest_flag(self, name: str) -> str | None:
        """The known option string nearest to `name`, if any is near."""
        known = [flag for flag in self._option_string_actions
                 if flag.startswith("--") == name.startswith("--")]
        matches = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        return matches[0] if matches else None

    def _respelled(self, args: list[str]) -> list[str]:
        """`--max_batch_size 4` as `--max-batch-size 4` where only the dashed flag exists;
        nothing after `--` (positional values)."""
        out = []
        for i, arg in enumerate(args):
            if arg == "--":
                return out + args[i:]
            name, equals, value = arg.partition("=")
            if (name.startswith("--") and "_" in name
                    and name not in self._option_string_actions):
                dashed = "--" + name[2:].replace("_", "-")
                if dashed in self._option_string_actions:
                    arg = dashed + equals + value
            out.append(arg)
        return out


def unrecognized_message(extras: list[str], hints: dict[str, str]) -> str:
    message = f"unrecognized arguments: {' '.join(extras)}"
    wanted = [(name, hints[name]) for name in dict.fromkeys(a.partition("=")[0] for a in extras)
              if name in hints]
    if len(wanted) == 1:
        return f"{message} (did you mean {wanted[0][1]}?)"
    if wanted:
        return f"{message} (did you mean {', '.join(f'{m} for {n}' for n, m in wanted)}?)"
    return message
