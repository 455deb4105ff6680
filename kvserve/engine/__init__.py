"""kvserve.engine"""
