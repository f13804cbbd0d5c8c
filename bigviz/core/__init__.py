"""bigviz.core"""
