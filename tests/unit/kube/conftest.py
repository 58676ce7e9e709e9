"""The Kubernetes adapter (`kubegpu.kube`), the rules for names from outside (`kubegpu.untrusted`)
and the Node events written through it (`kubegpu.events`).
"""
