"""``CompileCounters``: ``as_dict`` gives every field, in declaration order,
as plain values; ``expect`` checks a block's change to every field."""

import dataclasses

import pytest

from sgl_piecewise.errors import InvalidInputError, InvalidTypeError
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


# ---- expect: a block's change to the counters ------------------------------------
def _counted(counters: CompileCounters, replays=0, captured=0, fallbacks=(), paths=()) -> None:
    """What a block of steps would count."""
    counters.replays += replays
    counters.graphs_captured += captured
    for reason in fallbacks:
        counters.fallback(reason)
    for key in paths:
        counters.step_paths[key] += 1


def test_expect_passes_when_every_field_changes_as_named():
    counters = CompileCounters(replays=3, graphs_captured=1)
    counters.fallback("old reason")
    with counters.expect(graphs_captured=2, replays=5, eager_fallbacks={"no graph": 1}):
        _counted(counters, replays=5, captured=2, fallbacks=["no graph"])
    with counters.expect():  # nothing named: nothing may change
        pass
    with counters.expect(replays=0, step_paths={}):
        pass


def test_expect_names_a_field_whose_change_differs():
    counters = CompileCounters(replays=10)
    with pytest.raises(AssertionError) as raised:
        with counters.expect(graphs_captured=2, replays=5):
            _counted(counters, replays=4, captured=2)
    message = str(raised.value)
    assert "replays: expected +5, got +4" in message
    assert "graphs_captured" not in message  # as expected: not named


def test_expect_names_every_differing_field_and_an_unnamed_change():
    counters = CompileCounters()
    with pytest.raises(AssertionError) as raised:
        with counters.expect(replays=1, graphs_captured=3):
            _counted(counters, replays=2, captured=1)
            counters.steps_rerun += 1
    message = str(raised.value)
    assert "replays: expected +1, got +2" in message
    assert "graphs_captured: expected +3, got +1" in message
    assert "steps_rerun: expected +0 (not named), got +1" in message


def test_expect_refuses_an_unnamed_field_that_changed_unless_others_may():
    counters = CompileCounters()
    with pytest.raises(AssertionError, match=r"graphs_captured: expected \+0 \(not named\), got \+2"):
        with counters.expect(replays=1):
            _counted(counters, replays=1, captured=2)
    with pytest.raises(AssertionError, match=r"eager_fallbacks\['no graph'\]: expected \+0 \(not named\), got \+1"):
        with counters.expect(replays=1):
            _counted(counters, replays=1, fallbacks=["no graph"])
    with counters.expect(replays=1, others="any"):
        _counted(counters, replays=1, captured=2, fallbacks=["no graph"])
    # others="any" frees only unnamed fields: a named one still must match.
    with pytest.raises(AssertionError, match=r"replays: expected \+1, got \+0"):
        with counters.expect(replays=1, others="any"):
            _counted(counters, captured=2)


def test_expect_compares_counter_fields_key_by_key():
    counters = CompileCounters()
    _counted(counters, fallbacks=["no graph", "no graph"], paths=[("eager", "graphs='none'")])
    # A step path's key as the counter holds it, or as as_dict names it.
    with counters.expect(eager_fallbacks={"no graph": 1}, step_paths={("piecewise", "DECODE 3 -> 4 tokens"): 2}):
        _counted(counters, fallbacks=["no graph"], paths=[("piecewise", "DECODE 3 -> 4 tokens")] * 2)
    with counters.expect(step_paths={"piecewise: DECODE 3 -> 4 tokens": 1}):
        _counted(counters, paths=[("piecewise", "DECODE 3 -> 4 tokens")])
    with pytest.raises(AssertionError) as raised:
        with counters.expect(eager_fallbacks={"no graph": 1, "too big": 1}):
            _counted(counters, fallbacks=["no graph", "no graph", "other"])
    message = str(raised.value)
    assert "eager_fallbacks['no graph']: expected +1, got +2" in message
    assert "eager_fallbacks['too big']: expected +1, got +0" in message
    # A key the mapping leaves out must not change, even with others="any".
    assert "eager_fallbacks['other']: expected +0, got +1" in message
    with pytest.raises(AssertionError, match=r"step_paths\['eager: IDLE: no tokens'\]: expected \+0, got \+1"):
        with counters.expect(step_paths={("piecewise", "DECODE 3 -> 4 tokens"): 1}, others="any"):
            _counted(counters, paths=[("piecewise", "DECODE 3 -> 4 tokens"), ("eager", "IDLE: no tokens")])


def test_expect_lets_an_exception_in_the_block_propagate_unchanged():
    counters = CompileCounters()
    error = KeyError("from the block")
    with pytest.raises(KeyError) as raised:
        with counters.expect(replays=5):  # not met either: the block's error wins
            _counted(counters, replays=1)
            raise error
    assert raised.value is error
    with pytest.raises(AssertionError, match="^the block's own$"):
        with counters.expect(replays=5):
            raise AssertionError("the block's own")


def test_expect_checks_the_module_counters_and_sees_a_reset_in_the_block():
    from sgl_piecewise.compile import counters

    with counters.expect(replays=2, others="any"):
        counters.replays += 2
    counters.replays = 3
    with pytest.raises(AssertionError, match=r"replays: expected \+0, got -3"):
        with counters.expect(replays=0):
            counters.reset()


def test_expect_refuses_what_is_no_field_or_no_change_at_once():
    counters = CompileCounters()
    with pytest.raises(InvalidInputError, match=r"expect: expected a counter field \(graphs_split, .*\), got 'replay'"):
        counters.expect(replay=1)
    with pytest.raises(InvalidInputError, match=r"others: expected one of \('unchanged', 'any'\), got 'all'"):
        counters.expect(others="all")
    with pytest.raises(InvalidTypeError, match="replays: expected an int change, got True"):
        counters.expect(replays=True)
    with pytest.raises(InvalidTypeError, match="eager_fallbacks: expected a mapping of key to int change, got 1"):
        counters.expect(eager_fallbacks=1)
    with pytest.raises(InvalidTypeError, match="step_paths: expected a mapping"):
        counters.expect(step_paths={"eager: why": 1.0})


def test_expect_covers_fields_a_subclass_adds():
    @dataclasses.dataclass
    class MoreCounters(CompileCounters):
        new_counter: int = 0

    counters = MoreCounters()
    with counters.expect(new_counter=2):
        counters.new_counter += 2
    with pytest.raises(AssertionError, match=r"new_counter: expected \+0 \(not named\), got \+1"):
        with counters.expect():
            counters.new_counter += 1
