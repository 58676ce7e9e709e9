"""GetPreferredAllocation's choice (`kubegpu.placement`): the objective against brute force, the
search, replicas, the servicer, and properties over any valid config and node.
"""
