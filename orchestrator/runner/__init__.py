"""Running a job: the driver, its run directory and its live progress."""
