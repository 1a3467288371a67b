"""``CompileCounters.as_dict``: every field, in declaration order, as plain values."""

import dataclasses

from sgl_piecewise.graphs.counters import CompileCounters


def test_as_dict_names_every_field_in_order():
    @dataclasses.dataclass
    class MoreCounters(CompileCounters):
        new_counter: int = 0

    for counters in (CompileCounters(), MoreCounters(new_counter=3)):
        names = [f.name for f in dataclasses.fields(counters)]
        assert list(counters.as_dict()) == names
    assert MoreCounters(new_counter=3).as_dict()["new_counter"] == 3


def test_as_dict_gives_counters_as_plain_dicts():
    counters = CompileCounters(graphs_split=1, replays=7)
    counters.fallback("no graph")
    counters.fallback("no graph")
    counters.step_paths[("piecewise", "padded to 8")] += 2
    assert counters.as_dict() == {
        "graphs_split": 1,
        "pieces_seen": 0,
        "pieces_compiled": 0,
        "graphs_captured": 0,
        "replays": 7,
        "eager_fallbacks": {"no graph": 2},
        "artifacts_loaded": 0,
        "artifacts_saved": 0,
        "compiles_loaded": 0,
        "compiles_saved": 0,
        "steps_rerun": 0,
        "step_paths": {"piecewise: padded to 8": 2},
    }
    assert type(counters.as_dict()["eager_fallbacks"]) is dict
