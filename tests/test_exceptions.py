"""Every exception class the project defines survives being rebuilt from its
``args`` (SimPy re-raises a process's failure as ``type(e)(*e.args)``) and
pickling (a failure sent back from a worker process)."""
from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil
import signal
from types import ModuleType

import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

from megatronapp.io.interrupts import Interrupted

PACKAGES = ("megatronapp", "backends", "sim")


def _modules() -> list[ModuleType]:
    found = []
    for name in PACKAGES:
        package = importlib.import_module(name)
        found.append(package)
        for info in pkgutil.walk_packages(package.__path__, f"{name}."):
            found.append(importlib.import_module(info.name))
    return found


def _exception_classes() -> list[type[BaseException]]:
    classes = {cls for module in _modules() for _, cls in inspect.getmembers(module, inspect.isclass)
               if issubclass(cls, BaseException) and cls.__module__ == module.__name__}
    return sorted(classes, key=lambda c: f"{c.__module__}.{c.__qualname__}")


CLASSES = _exception_classes()
def _instances(cls: type[BaseException]) -> st.SearchStrategy[BaseException]:
    """Built with arguments of the types ``__init__`` declares (a message when
    it takes the base class's ``*args``)."""
    if cls is Interrupted:  # its argument is a signal number, not any int
        return st.sampled_from(list(signal.Signals)).map(cls)
    if not any("__init__" in vars(c) for c in cls.__mro__
               if c.__module__.split(".")[0] in PACKAGES):
        return st.builds(cls, st.text(max_size=40))
    return st.builds(cls)


def test_the_walk_finds_the_classes_the_simulator_may_carry():
    names = {c.__name__ for c in CLASSES}
    assert {"Interrupted", "UserError", "TraceError", "ScenarioError", "MemoryExceeded",
            "SimDeadlock", "TorchRankFailed"} <= names


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: f"{c.__module__}.{c.__qualname__}")
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_an_exception_is_rebuilt_from_its_args_and_from_a_pickle(cls, data):
    err = data.draw(_instances(cls))
    for rebuilt in (type(err)(*err.args), pickle.loads(pickle.dumps(err))):
        assert type(rebuilt) is type(err)
        assert str(rebuilt) == str(err) and rebuilt.args == err.args


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_raised_inside_a_simpy_process_reaches_the_caller_as_itself(sig):
    env = simpy.Environment()

    def stopped(env: simpy.Environment):
        yield env.timeout(1)
        raise Interrupted(sig)

    env.process(stopped(env))
    with pytest.raises(Interrupted) as caught:
        env.run()
    assert caught.value.signum == sig and caught.value.line() == f"interrupted ({sig.name})"
