"""A loop file the recovery tests interrupt: one state that appends `tick` to
`${context.marker}` every 0.2 s and counts to 6 (the CLI and checkpoint tests share it)."""

COUNTER = """\
name: count-to-six
description: Count to six, one state execution at a time, leaving a tick per step.
initial: count
max_iterations: 40
timeout: 60
states:
  count:
    action: echo tick >> ${context.marker}; sleep 0.2; expr ${captured.n.output:default=0} + 1
    capture: n
    evaluate:
      type: output_numeric
      operator: ge
      target: 6
    route:
      yes: done
      no: count
  done:
    terminal: true
"""
