"""The test rig itself: the kubelet emulator's rooms without sockets (`kubegpu.kubelet`), the DRA
kubelet and scheduler stand-in (`tests.rig.dra`), and FakeKube's request counts
(`tests.rig.kube`).
"""
