"""kvserve.cache"""
