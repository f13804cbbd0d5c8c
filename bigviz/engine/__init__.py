"""bigviz.engine"""
