"""The device plugin's own parts (`kubegpu.plugin`, `kubegpu.allocation`): the Allocate answer,
the plugin directory's roles and slots, registration and kubelet-restart detection, the redial
pacing.
"""
