"""Tools around the cost model and the machine, the last stage with the CLI: the ``compass-fx``
subcommands (``commands``: plan, sweep, calibrate), the planning grid (``sweep``), the measuring
driver of ``compass-fx calibrate`` (``calibrate``, ``timing``) and the timeline picture
(``timeline_plot``).  Nothing in the compiler imports them.
"""
