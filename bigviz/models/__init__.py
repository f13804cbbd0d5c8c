"""bigviz.models"""
