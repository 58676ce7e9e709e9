"""MPS daemon supervision (`kubegpu.mps`) against the stand-in control binary
(tests/fixtures/fake-mps-control), and when that binary misbehaves.
"""
