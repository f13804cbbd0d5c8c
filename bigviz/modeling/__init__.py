"""bigviz.modeling"""
