"""bigviz.checkpoint"""
