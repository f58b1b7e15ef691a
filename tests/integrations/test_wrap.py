"""integrations/wrap.py: the one way our seams replace host attributes."""

import types

import pytest

from cppo_megatron.integrations import wrap as w


def _host():
    mod = types.ModuleType("host")

    def f(x):
        return x + 1

    class C:
        def m(self):
            return "C.m"

        @staticmethod
        def s():
            return "C.s"

    class D(C):
        pass

    mod.f, mod.C, mod.D = f, C, D
    return mod


def _plus(k):
    def make(fn):
        def wrapper(x):
            return fn(x) + k
        return wrapper
    return make


def test_wrap_marks_the_original_and_a_second_install_changes_nothing():
    host = _host()
    f = host.f
    assert w.wrap(host, "f", _plus(10), tag="a") is True
    assert host.f(1) == 12
    assert getattr(host.f, w.ORIGINAL) is f and getattr(host.f, w.TAG) == "a"
    top = host.f
    assert w.wrap(host, "f", _plus(10), tag="a") is False  # double install: told, not stacked
    assert host.f is top and host.f(1) == 12
    assert w.original(host.f) is f and w.is_wrapped(host.f, "a") and not w.is_wrapped(f)


def test_layers_stack_and_unwrap_takes_out_exactly_one_wherever_it_sits():
    host = _host()
    f = host.f
    w.wrap(host, "f", _plus(10), tag="a")
    w.wrap(host, "f", _plus(100), tag="b")
    assert host.f(1) == 112 and w.is_wrapped(host.f, "a") and w.original(host.f) is f
    # a double install of the lower layer is seen through the upper one
    assert w.wrap(host, "f", _plus(10), tag="a") is False and host.f(1) == 112
    assert w.unwrap(host, "f", tag="a") is True  # the lower layer: spliced out
    assert host.f(1) == 102 and not w.is_wrapped(host.f, "a") and w.original(host.f) is f
    assert w.unwrap(host, "f", tag="a") is False
    assert w.unwrap(host, "f", tag="b") is True and host.f is f


def test_methods_inherited_and_static():
    host = _host()
    m = host.C.__dict__["m"]
    w.wrap(host.D, "m", lambda fn: (lambda self: "D:" + fn(self)), tag="t")
    assert host.D().m() == "D:C.m" and host.C().m() == "C.m"  # only the subclass changed
    assert w.unwrap(host.D, "m", tag="t") and "m" not in host.D.__dict__  # inherited again, not copied
    assert host.D.m is m
    w.wrap(host.D, "m", lambda fn: (lambda self: "1:" + fn(self)), tag="one")
    w.wrap(host.D, "m", lambda fn: (lambda self: "2:" + fn(self)), tag="two")
    assert host.D().m() == "2:1:C.m"
    w.unwrap(host.D, "m", tag="one")  # the lowest layer of an inherited name: the one above rebuilt on C.m
    assert host.D().m() == "2:C.m" and w.original(host.D.__dict__["m"]) is m
    w.unwrap(host.D, "m", tag="two")
    assert "m" not in host.D.__dict__

    # an inherited slot wrapper (object.__getattribute__): no __dict__ of its own, still wrapped
    seen = []

    def spy(get):
        def __getattribute__(self, name):
            seen.append(name)
            return get(self, name)
        return __getattribute__

    assert w.wrap(host.D, "__getattribute__", spy, tag="t")
    assert w.wrap(host.D, "__getattribute__", spy, tag="t") is False
    assert host.D().m() == "C.m" and seen == ["m"] and w.original(host.D.__getattribute__) is object.__getattribute__
    w.unwrap(host.D, "__getattribute__", tag="t")
    assert "__getattribute__" not in host.D.__dict__ and not w.is_wrapped(object.__getattribute__, "t")

    s = host.C.__dict__["s"]
    w.wrap(host.C, "s", lambda sm: staticmethod(lambda: "w:" + sm.__func__()), tag="t")
    assert host.C.s() == "w:C.s" and w.original(host.C.__dict__["s"]) is s
    w.unwrap(host.C, "s", tag="t")
    assert host.C.__dict__["s"] is s


def test_bad_calls_name_what_is_wrong():
    host = _host()
    with pytest.raises(AttributeError, match="has no attribute 'gone'.*host moved"):
        w.wrap(host, "gone", _plus(1), tag="a")
    with pytest.raises(ValueError, match="tag must name the seam"):
        w.wrap(host, "f", _plus(1), tag="")
    with pytest.raises(ValueError, match="new object"):
        w.wrap(host, "f", lambda fn: fn, tag="a")


def test_wrapped_block_installs_for_its_duration_and_nests():
    host = _host()
    f = host.f
    with w.wrapped(host, "f", _plus(10), tag="a") as installed:
        assert installed is True and host.f(1) == 12
        with w.wrapped(host, "f", _plus(10), tag="a") as again:  # the outer block's layer: kept
            assert again is False and host.f(1) == 12
        assert host.f(1) == 12
    assert host.f is f
    with pytest.raises(RuntimeError, match="boom"), w.wrapped(host, "f", _plus(10), tag="a"):
        raise RuntimeError("boom")
    assert host.f is f


def test_replace_keeps_and_marks_what_it_stands_in_for():
    host = _host()
    f = host.f

    def stand_in(x):
        return 0

    assert w.replace(host, "f", stand_in, tag="cpu") is True and host.f is stand_in and host.f(5) == 0
    assert w.replace(host, "f", stand_in, tag="cpu") is False and w.original(host.f) is f
    assert w.unwrap(host, "f", tag="cpu") and host.f is f


@pytest.mark.parametrize("name", ["", None])
def test_an_attribute_name_that_is_empty_or_not_a_string_is_refused(name):
    host = _host()
    with pytest.raises(ValueError, match=f"^wrap: attribute name must be a non-empty string, got {name!r}$"):
        w.wrap(host, name, _plus(1), tag="a")
    assert w.original(host.f) is host.f  # nothing installed


def test_wrap_methods_wraps_each_named_method_or_names_the_one_gone():
    host = _host()

    def tagged(fn):
        def wrapper(self):
            return "cppo " + fn(self)
        return wrapper

    w.wrap_methods(host, ("host", "C"), {"m": tagged, "s": lambda fn: staticmethod(lambda: "new")}, tag="t",
                   changed="host changed (pinned 1.0)")
    assert host.C().m() == "cppo C.m" and host.C.s() == "new"
    assert w.is_wrapped(host.C.__dict__["m"], "t")
    # D only inherits m: a seam on D's own m is gone, and nothing was wrapped
    with pytest.raises(RuntimeError, match=r"^cppo: host.D.m is gone; host changed \(pinned 1.0\)$"):
        w.wrap_methods(host, ("host", "D"), {"m": tagged}, tag="u", changed="host changed (pinned 1.0)")
    with pytest.raises(RuntimeError, match=r"^cppo: host.E.m is gone; "):
        w.wrap_methods(host, ("host", "E"), {"m": tagged}, tag="u", changed="host changed (pinned 1.0)")
    # a method missing after the first: the first is wrapped, the error names the second
    with pytest.raises(RuntimeError, match=r"host.C.nope is gone"):
        w.wrap_methods(host, ("host", "C"), {"m": tagged, "nope": tagged}, tag="v", changed="x")
    with pytest.raises(ValueError, match="no methods to wrap on host.C; name at least one"):
        w.wrap_methods(host, ("host", "C"), {}, tag="w", changed="x")
    # who relied on it begins the message (a diagnostic's own words)
    with pytest.raises(RuntimeError, match=r"^cppo audit: host.D.m is gone; host changed$"):
        w.wrap_methods(host, ("host", "D"), {"m": tagged}, tag="u", changed="host changed", who="cppo audit")
