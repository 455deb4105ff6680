"""kvserve.server"""
