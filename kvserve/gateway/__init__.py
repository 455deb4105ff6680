"""kvserve.gateway"""
