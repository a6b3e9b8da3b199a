"""What every part of the recipe uses: rank-0 output and the metrics file (`metrics`), failures, stop
requests and errors named by their config key (`faults`), files that are whole or absent (`files`)."""
