"""XLA flags of the test subprocesses that simulate several CPU devices."""


def xla_flags(devices: int) -> str:
    """`devices` host-platform devices whose collectives wait up to 5 minutes for each other.

    The simulated devices are threads of one process: on a loaded 2-core machine XLA's default
    40 s rendezvous timeout can expire before every device's thread reaches an all-reduce, and XLA
    then aborts the run. A run that hangs (all devices' threads blocked) still fails within
    minutes.
    """
    return (
        f"--xla_force_host_platform_device_count={devices} "
        "--xla_cpu_collective_call_terminate_timeout_seconds=300"
    )
