import inspect

import swarmtrain.dht
from swarmtrain.dht import (
    blacklist,
    call_failures,
    identifiers,
    routing,
    serialization,
    storage,
    storage_quota,
    traverse,
    validation,
)

MODULES = [
    blacklist,
    call_failures,
    identifiers,
    routing,
    serialization,
    storage,
    storage_quota,
    traverse,
    validation,
]


def test_every_public_name_is_exported_and_documented():
    for module in MODULES:
        for name in module.__all__:
            obj = getattr(module, name)
            assert getattr(swarmtrain.dht, name) is obj, name
            if inspect.isclass(obj) or inspect.isfunction(obj):
                assert obj.__doc__, f"{module.__name__}.{name} has no docstring"


def test_pure_modules_do_not_import_io_or_clock():
    for module in MODULES:
        imports = [
            line.split()[1]
            for line in inspect.getsource(module).splitlines()
            if line.startswith(("import ", "from "))
        ]
        assert not {"libp2p", "socket", "trio", "asyncio"} & set(imports), module.__name__
        if module is not storage:  # get_dht_time is the one place that reads the clock
            assert "time" not in imports, module.__name__
