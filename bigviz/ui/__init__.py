"""bigviz.ui"""
