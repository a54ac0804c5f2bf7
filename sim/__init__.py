"""SimPy model of a GPU cluster: devices, links, collectives, faults, clocks."""
