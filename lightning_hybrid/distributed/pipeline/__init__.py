"""Pipeline parallelism: schedules (names, rules, bubble), stage split, runner, and stage timing."""
