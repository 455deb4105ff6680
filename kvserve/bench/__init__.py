"""kvserve.bench"""
