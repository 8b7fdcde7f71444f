# Prints, for every code object of a few stdlib modules, what memtrace needs to compute
# lines (first line, line table) and what CPython itself says (co_lines), one JSON object
# per line: memtrace/tests/python.rs compares the two at every instruction.
import importlib
import json
import sys
import types

MODULES = ["json.decoder", "inspect", "argparse", "dataclasses", "asyncio.base_events", "typing"]


def walk(code):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from walk(const)


for name in MODULES:
    module = importlib.import_module(name)
    source = module.__spec__.loader.get_code(name)
    for code in walk(source):
        print(json.dumps({
            "minor": sys.version_info.minor,
            "name": code.co_name,
            "firstlineno": code.co_firstlineno,
            "linetable": code.co_linetable.hex(),
            "units": len(code.co_code) // 2,
            "lines": [[s, e, l] for s, e, l in code.co_lines()],
        }))
